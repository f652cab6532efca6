"""What the kernel tests share: operands in each layout, checks of a product against float64 torch, and building
what a Triton family or the padded backend offers for (a, b), with a check of a runner's launches."""
import pytest
import torch

from backends.padded import PaddedBackend
from backends.triton import TritonBackend
from backends.triton_templates import family
from kernels.core.problem import GemmProblem


def operand(rows, cols, layout, dtype):
    """A CPU operand: row- or column-major, `sliced` (leading dimension longer than a row) or `strided` (no unit
    stride at all)."""
    def rand(r, c):
        if dtype == torch.int8:
            return torch.randint(-128, 128, (r, c), dtype=torch.int8)
        return torch.randn(r, c).to(dtype)
    if layout == "row":
        return rand(rows, cols)
    if layout == "col":
        return rand(cols, rows).t()
    if layout == "sliced":
        return rand(rows, cols + 7)[:, :cols]
    return rand(rows * 2, cols * 3)[::2, ::3]


def cuda_operand(rows, cols, layout, dtype):
    """A GPU operand: row- or column-major, or `sliced` (leading dimension 8 elements longer than a row)."""
    def rand(r, c):
        if dtype == torch.int8:
            return torch.randint(-128, 128, (r, c), dtype=torch.int8, device="cuda")
        return torch.randn(r, c, device="cuda").to(dtype)
    if layout == "row":
        return rand(rows, cols)
    if layout == "col":
        return rand(cols, rows).t()
    return rand(rows, cols + 8)[:, :cols]


def rel_err(c, a, b) -> float:
    ref = a.double() @ b.double()
    return float((c.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def assert_close(c, a, b):
    """c is a @ b: exact for int8 (int32 out), else within fp16/bf16 (or exact-fp32) rounding of float64 torch."""
    ref = a.double() @ b.double()
    if a.dtype == torch.int8:
        assert c.dtype == torch.int32 and torch.equal(c.double(), ref)
    else:
        # relative to the result, unless cancellation made the result small against the terms summed
        # (a 1x1 output of 700 random products): then relative to the typical size of such a sum
        scale = torch.maximum(ref.norm(), (a.double().abs() @ b.double().abs()).norm() / max(a.shape[1], 1) ** 0.5)
        err = (c.double() - ref).norm() / scale.clamp_min(1e-30)
        tol = 1e-5 if (a.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest") else 1e-2
        assert c.dtype == a.dtype and err < tol, float(err)


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
    m, n = a.shape[0], b.shape[1]
    for _ in range(calls):
        c = runner.launch(a, b, None)
        assert c.shape == (m, n) and c.is_contiguous()
        assert_close(c, a, b)
    out = torch.empty(m, n + out_pad, dtype=c.dtype, device=c.device)[:, :n]
    assert runner.launch(a, b, out) is out
    assert_close(out, a, b)
