"""Persistent TMA template: when descriptors can describe the problem, and interpreter correctness (aligned
strides, both layouts, M/N smaller than a block, K not a multiple of the block, persistent loop over several
tiles per program)."""
import pytest
import torch

from backends.triton_templates import family
from backends.triton_templates.tma import tma_unsupported
from kernels.core.config import interpret_mode
from tests.helpers import problem
from kernels.core.problem import GemmProblem
from tests.triton_helpers import assert_close, build_offered, op_of, operand


def test_descriptor_rules():
    assert tma_unsupported(problem()) == ""
    assert "sm90" in tma_unsupported(problem(arch=80))
    assert "leading" in tma_unsupported(problem(k=4095))
    assert "output rows" in tma_unsupported(problem(n=4095, stride_b=(4096, 1)))
    # a broadcast operand (expand: stride 0) and rows that overlap: plain loads serve them, a descriptor may not
    assert "overlap" in tma_unsupported(problem(stride_a=(0, 1)))
    assert "overlap" in tma_unsupported(problem(stride_b=(1, 8)))                 # column-major B, 8 < K
    assert tma_unsupported(problem(m=1, stride_a=(0, 1))) == ""                  # one row: nothing to overlap
    choices, _ = family("triton_tma_mm").choices(problem(), "triton_tma_mm", "default")
    assert choices and all(c.config.num_warps >= 4 for c in choices)
    assert any(dict(c.params).get("sub") for c in choices)          # 128x256 tiles get a subtiled epilogue too


@pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("m,n,k,la,lb", [(40, 48, 80, "row", "row"), (130, 72, 64, "row", "col"),
                                         (200, 160, 96, "col", "col"), (8, 16, 48, "col", "row")])
def test_tma_matches_torch(dtype, m, n, k, la, lb):
    """Every case is offered and matches torch, but the known refusals, whose reasons are checked: a template that
    stopped offering must fail here, not skip."""
    a, b = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    template = "triton_tma_int8_mm" if dtype == torch.int8 else "triton_tma_mm"
    refused = TMA_REFUSED.get((m, n, k, la, lb, dtype))
    if refused is not None:
        choices, skipped = family(template).choices(GemmProblem.from_tensors(op_of(a), a, b), template, "default")
        assert not choices and refused in skipped[template]
        return
    for outcome in build_offered(template, a, b, limit=2, require=True):
        assert_close(outcome.runner.launch(a, b, None), a, b)


# the cases above that the templates refuse, and why: fp32 at these K has no persistent tile that fits shared memory;
# an int8 A stored column-major with 200 or 8 rows has a leading dimension TMA cannot describe
TMA_REFUSED = {(130, 72, 64, "row", "col", torch.float32): "no persistent config fits shared memory",
               (200, 160, 96, "col", "col", torch.float32): "no persistent config fits shared memory",
               (200, 160, 96, "col", "col", torch.int8): "TMA needs 16-byte aligned leading dimensions",
               (8, 16, 48, "col", "row", torch.int8): "TMA needs 16-byte aligned leading dimensions"}
