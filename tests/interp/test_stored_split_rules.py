"""A split-K choice that the candidate space would never make for the problem (a stored entry edited by hand, a
pinned table entry) is refused when it is built, never run: split 4096 on K=16 faulted the interpreter (a probe)."""
import torch

from backends import get_backend
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.heuristics import GemmConfig


def _outcome(template, cfg, split, k=16):
    a, b = torch.randn(16, k), torch.randn(k, 16)
    p = GemmProblem.from_tensors("mm", a, b)
    return get_backend("triton").build(p, [Choice("triton", template, "fp32", cfg, (("split", split),))])[0]


def test_a_split_with_empty_k_ranges_is_refused_at_build():
    cfg = GemmConfig(16, 16, 16, 1, 2)
    for split in (2, 64, 4096):
        out = _outcome("split_k", cfg, split)
        assert out.runner is None and "no K-range" in out.error, out.error
    assert _outcome("split_k", cfg, 2, k=64).runner is not None        # four blocks, two splits of two


def test_a_decompose_split_that_does_not_divide_k_is_refused_at_build():
    out = _outcome("decompose_k", None, 3, k=400)
    assert out.runner is None and "does not divide K=400" in out.error, out.error
