"""aten: `torch.mm` and `torch._int_mm`, always a candidate so the tuned call is never slower than PyTorch's."""
from __future__ import annotations

import torch

from backends.base import Backend, BuildOutcome, Runner
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem


def _mm(a, b, out):
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def _int_mm(a, b, out):
    return torch._int_mm(a, b) if out is None else torch._int_mm(a, b, out=out)


# what kernels.mm's warm path calls for out=None: torch's own function, no Python frame in between
_mm.direct = torch.mm
_int_mm.direct = torch._int_mm


def int_mm_limits(problem: GemmProblem) -> str:
    """aten's own rules for torch._int_mm on CUDA (cuBLASLt): '' when it can run, else the reason."""
    if problem.device != "cuda":
        return ""
    if problem.m <= 16:
        return "torch._int_mm needs M > 16"
    if problem.k % 8 or problem.n % 8:
        return "torch._int_mm needs K and N multiples of 8"
    return ""


class AtenBackend(Backend):
    name = "aten"

    def available(self, problem: GemmProblem) -> tuple[bool, str]:
        return True, ""

    def choices(self, problem, space="default"):
        if problem.op == "int_mm":
            why = int_mm_limits(problem)
            choice = Choice("aten", "aten_int_mm", problem.dtype)
            return ([], {choice.name: why}) if why else ([choice], {})
        return [Choice("aten", "aten_mm", problem.dtype)], {}

    def build(self, problem, choices):
        fns = {"aten_mm": _mm, "aten_int_mm": _int_mm}
        return [BuildOutcome(c, Runner(c, fns[c.template])) for c in choices]


def create() -> AtenBackend:
    return AtenBackend()
