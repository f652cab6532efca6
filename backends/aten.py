"""aten: `torch.mm`, `torch._int_mm`, `torch._scaled_mm` and (for products with an epilogue) `torch.addmm` plus the
activation, always a candidate so the tuned call is never slower than PyTorch's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.base import Backend, BuildOutcome, Runner
from kernels.core.choice import Choice
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem


def _mm(a, b, out):
    return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)


def _int_mm(a, b, out):
    return torch._int_mm(a, b) if out is None else torch._int_mm(a, b, out=out)


# what kernels.mm's warm path calls for out=None: torch's own function, no Python frame in between
_mm.direct = torch.mm
_int_mm.direct = torch._int_mm

# in place, so the epilogue adds no allocation; gelu as the kernels compute it (tanh approximation)
_ACTIVATE = {"": None, "relu": torch.relu_, "silu": lambda t: F.silu(t, inplace=True),
             "gelu": lambda t: t.copy_(F.gelu(t, approximate="tanh"))}


def epilogue_launch(problem: GemmProblem):
    """launch(a, b[, bias], out=None) for a problem with an epilogue: torch.addmm (cuBLASLt fuses the bias) or
    torch.mm, then the activation in place."""
    act = _ACTIVATE[problem.activation]
    if problem.bias:
        def launch(a, b, bias, out=None):
            out = torch.addmm(bias, a, b) if out is None else torch.addmm(bias, a, b, out=out)
            return out if act is None else act(out)
    else:
        def launch(a, b, out=None):
            out = torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
            return out if act is None else act(out)
    return launch


def scaled_mm_launch(problem: GemmProblem):
    """launch(a, b, scale_a, scale_b[, bias], out=None): torch._scaled_mm with the problem's output dtype."""
    out_dtype = DTYPES_BY_NAME[problem.out_dtype]
    scaled = torch._scaled_mm
    if problem.bias:
        def launch(a, b, scale_a, scale_b, bias, out=None):
            return scaled(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, out=out)
    else:
        def launch(a, b, scale_a, scale_b, out=None):
            return scaled(a, b, scale_a, scale_b, out_dtype=out_dtype, out=out)
    return launch


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
    epilogues = True

    def available(self, problem: GemmProblem) -> tuple[bool, str]:
        return True, ""

    def choices(self, problem, space="default"):
        if problem.op == "int_mm":
            why = int_mm_limits(problem)
            choice = Choice("aten", "aten_int_mm", problem.dtype)
            return ([], {choice.name: why}) if why else ([choice], {})
        if problem.op == "scaled_mm":
            return [Choice("aten", "aten_scaled_mm", problem.dtype)], {}
        if problem.epilogue:
            return [Choice("aten", "aten_addmm", problem.dtype)], {}
        return [Choice("aten", "aten_mm", problem.dtype)], {}

    def build(self, problem, choices):
        fns = {"aten_mm": lambda: _mm, "aten_int_mm": lambda: _int_mm, "aten_addmm": lambda: epilogue_launch(problem),
               "aten_scaled_mm": lambda: scaled_mm_launch(problem)}
        return [BuildOutcome(c, Runner(c, fns[c.template]())) for c in choices]


def create() -> AtenBackend:
    return AtenBackend()
