"""Build what a Triton template family offers for (a, b): the setup every template test shares."""
import pytest
import torch

from backends.triton import TritonBackend
from backends.triton_templates import family
from kernels.problem import GemmProblem


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
