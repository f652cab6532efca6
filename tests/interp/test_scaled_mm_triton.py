"""fp8 scaled_mm in every Triton family that serves it (the tiled kernel, persistent TMA, split_k), run by the
interpreter on CPU against float64 (a @ b) * scale_a * scale_b + bias on the dequantized inputs; and kernels.scaled_mm
end to end, its warm call served from memory."""
import dataclasses

import pytest
import torch

import kernels
from backends.triton import TritonBackend
from kernels.core.choice import Choice
from kernels.core.config import config, interpret_mode
from kernels.core.errors import InputValueError
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.measure.verify import check, make_inputs, reference
from kernels.space.heuristics import GemmConfig

interpreted = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

# template -> ((m, n, k), config, params). M and N are not multiples of the tile (the scale and bias loads are
# masked), K is not a multiple of block_k for the tiled kernel (masked fp8 loads), split_k splits K four ways (a
# scale applied per split would still be right; a bias added per split would not).
FAMILIES = {
    "triton_scaled_mm": ((20, 48, 80), GemmConfig(16, 32, 32, 1, 1), ()),
    "triton_tma_scaled_mm": ((20, 48, 64), GemmConfig(16, 32, 32, 1, 4), (("sub", 1),)),
    "split_k": ((20, 48, 256), GemmConfig(16, 32, 32, 1, 1), (("split", 4),)),
}


def scaled_problem(m, n, k, dtype="e4m3", scaling="tensor", bias=False, out_dtype="bf16") -> GemmProblem:
    a = torch.empty(m, k, dtype=DTYPES_BY_NAME[dtype])
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn).t()
    return GemmProblem.from_tensors("scaled_mm", a, b, bias=bias, scaling=scaling, out_dtype=out_dtype)


def build(template: str, p: GemmProblem):
    _, cfg, params = FAMILIES[template]
    (outcome,) = TritonBackend().build(p, [Choice("triton", template, p.dtype, cfg, params)])
    assert outcome.runner is not None, outcome.error
    return outcome.runner.launch


@interpreted
@pytest.mark.parametrize("template", list(FAMILIES))
@pytest.mark.parametrize("scaling,bias,out_dtype", [("tensor", False, "bf16"), ("row", True, "bf16"),
                                                    ("row", False, "fp16"), ("tensor", True, "fp32")])
def test_family_applies_scales_and_bias(template, scaling, bias, out_dtype):
    (m, n, k), _, _ = FAMILIES[template]
    p = scaled_problem(m, n, k, scaling=scaling, bias=bias, out_dtype=out_dtype)
    launch = build(template, p)
    operands = make_inputs(p, "cpu", seed=3)
    ref = reference(p, *operands)
    out = launch(*operands)
    assert out.dtype == DTYPES_BY_NAME[out_dtype] and out.shape == (m, n)
    assert check(p, out, ref).ok
    # into the caller's out, rows longer than N (staged or written in place: the same numbers)
    wide = torch.empty(m, n + 16, dtype=out.dtype)[:, :n]
    assert launch(*operands, wide) is wide and check(p, wide, ref).ok


@interpreted
@pytest.mark.parametrize("template", list(FAMILIES))
def test_e5m2_a_times_e4m3_b(template):
    (m, n, k), _, _ = FAMILIES[template]
    p = scaled_problem(m, n, k, dtype="e5m2", scaling="row")
    operands = make_inputs(p, "cpu", seed=5)
    assert operands[0].dtype == torch.float8_e5m2 and operands[1].dtype == torch.float8_e4m3fn
    assert check(p, build(template, p)(*operands), reference(p, *operands)).ok


@interpreted
def test_a_wrong_scale_is_caught_by_verification():
    """Swapping the scales' roles (row-wise: scale_a per row, scale_b per column) must fail the check: the
    reference and the kernels agree on which is which."""
    p = scaled_problem(20, 48, 64, scaling="row")
    a, b, sa, sb = make_inputs(p, "cpu", seed=7)
    launch = build("triton_scaled_mm", dataclasses.replace(p))
    wrong = launch(a, b, torch.ones_like(sa), sb)
    assert not check(p, wrong, reference(p, a, b, sa, sb)).ok


@interpreted
def test_scaled_mm_end_to_end_through_a_triton_winner():
    """kernels.scaled_mm tunes (one Triton candidate, no aten: on the CPU torch._scaled_mm would win), returns the
    right numbers, and its second call is a memory hit."""
    config.backends = ("triton",)
    config.only = ("^triton_scaled_mm_e4m3_32x32x32_s4_w4_",)
    torch.manual_seed(0)
    a = torch.randn(24, 64).to(torch.float8_e4m3fn)
    w = torch.randn(32, 64).to(torch.float8_e4m3fn)
    sa, sb = torch.rand(24, 1) + 0.5, torch.rand(1, 32) + 0.5
    bias = torch.randn(32).to(torch.bfloat16)
    before = kernels.stats()
    out = kernels.scaled_mm(a, w.t(), sa, sb, bias=bias)
    ref = (a.double() @ w.double().t()) * sa.double() * sb.double() + bias.double()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    sel = kernels.explain(a, w.t(), op="scaled_mm", scale_a=sa, scale_b=sb, bias=bias)
    assert sel.winner.startswith("triton_scaled_mm_e4m3_32x32x32"), sel.timings
    assert kernels.stats()["tunes"] == before["tunes"] + 1
    hits = kernels.stats()["memory_hits"]
    again = kernels.scaled_mm(a, w.t(), sa, sb, bias=bias)
    assert torch.equal(again, out) and kernels.stats()["memory_hits"] == hits + 1
    # the warm path takes an out= only where the cold path's checks would (kernels.dispatch.out_arg): an expanded one
    # is refused as on a first call, never handed to the winner
    expanded = torch.empty(1, 32, dtype=torch.bfloat16).expand(24, 32)
    with pytest.raises(InputValueError, match="out has elements that share memory"):
        kernels.scaled_mm(a, w.t(), sa, sb, bias=bias, out=expanded)
    into = torch.empty(24, 32, dtype=torch.bfloat16)
    assert kernels.scaled_mm(a, w.t(), sa, sb, bias=bias, out=into) is into and torch.equal(into, out)
