"""What the template tests share: build what a Triton family or the padded backend offers for (a, b), and check a
runner's launches."""
import pytest
import torch

from backends.triton import TritonBackend
from backends.triton_templates import family
from kernels.core.problem import GemmProblem


def op_of(a: torch.Tensor) -> str:
    return "int_mm" if a.dtype == torch.int8 else "mm"


def build_offered(template: str, a: torch.Tensor, b: torch.Tensor, limit: int, require: bool = False) -> list:
    """The first `limit` choices the template offers for the problem of (a, b), built, each with a runner (asserted).
    A template that offers nothing skips the test, or fails it when `require`."""
    p = GemmProblem.from_tensors(op_of(a), a, b)
    choices, skipped = family(template).choices(p, template, "default")
    if require:
        assert choices, skipped
    elif not choices:
        pytest.skip(f"{template} not offered: {skipped}")
    outcomes = TritonBackend().build(p, choices[:limit])
    for outcome in outcomes:
        assert outcome.runner is not None, outcome.error
    return outcomes


def build_padded(a: torch.Tensor, b: torch.Tensor, require_available: bool = False) -> tuple[list, dict[str, str]]:
    """Every choice the padded backend offers for the problem of (a, b), built, each with a runner (asserted), and
    the choices it left out (name -> why); with `require_available`, the backend must say it is available."""
    from backends.padded import PaddedBackend

    p = GemmProblem.from_tensors(op_of(a), a, b)
    backend = PaddedBackend()
    if require_available:
        assert backend.available(p)[0]
    choices, skipped = backend.choices(p)
    outcomes = backend.build(p, choices)
    for outcome in outcomes:
        assert outcome.runner is not None, outcome.error
    return outcomes, skipped


def check_launches(runner, a: torch.Tensor, b: torch.Tensor, calls: int = 1, out_pad: int = 3) -> None:
    """`calls` launches in a row each return torch's product in a fresh contiguous (M, N) tensor (buffers a runner
    reuses between calls must not leak stale data), and a caller's `out` with rows `out_pad` longer than N is
    written in place."""
    from tests.test_triton_interpreter import assert_close

    m, n = a.shape[0], b.shape[1]
    for _ in range(calls):
        c = runner.launch(a, b, None)
        assert c.shape == (m, n) and c.is_contiguous()
        assert_close(c, a, b)
    out = torch.empty(m, n + out_pad, dtype=c.dtype, device=c.device)[:, :n]
    assert runner.launch(a, b, out) is out
    assert_close(out, a, b)
