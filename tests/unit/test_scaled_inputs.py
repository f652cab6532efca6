"""kernels.scaled_mm's bad input: each a TypeError / ValueError naming the argument, raised before anything runs;
and the fp8 rules of supports()."""
import dataclasses

import pytest
import torch

import kernels
from kernels.core.errors import InputTypeError, InputValueError
from kernels.space.heuristics import GemmConfig, supports
from tests.helpers import problem

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
M, N, K = 32, 48, 64


def operands(m=M, n=N, k=K, scaling="tensor"):
    a = torch.randn(m, k).to(E4M3)
    b = torch.randn(n, k).to(E4M3).t()
    if scaling == "tensor":
        return a, b, torch.tensor(0.5), torch.tensor(2.0)
    return a, b, torch.rand(m, 1) + 0.5, torch.rand(1, n) + 0.5


def raises(kind, match, *args, **kwargs):
    with pytest.raises(kind, match=match):
        kernels.scaled_mm(*args, **kwargs)


def test_dtypes_are_named():
    a, b, sa, sb = operands()
    raises(InputTypeError, "a must be one of float8_e4m3fn, float8_e5m2", a.to(torch.bfloat16), b, sa, sb)
    raises(InputTypeError, "b must be float8_e4m3fn.*e5m2 x e5m2", a.to(E5M2), b.to(E5M2), sa, sb)
    raises(InputTypeError, "scale_a must be float32", a, b, sa.double(), sb)
    raises(InputTypeError, "scale_b must be float32", a, b, sa, sb.half())
    raises(InputTypeError, "out_dtype must be one of bfloat16, float16, float32", a, b, sa, sb, out_dtype=E4M3)
    raises(InputTypeError, "bias has dtype torch.float32, expected out_dtype torch.bfloat16", a, b, sa, sb,
           bias=torch.zeros(N))
    raises(InputTypeError, "scale_a must be a torch.Tensor, got float", a, b, 0.5, sb)


def test_shapes_layouts_and_scales_are_named():
    a, b, sa, sb = operands()
    raises(InputValueError, "inner dimensions differ", a[:, :48], b, sa, sb)
    raises(InputValueError, "a must be 2-D", a[None], b, sa, sb)
    raises(InputValueError, "a must be row-major", a.t().contiguous().t(), b, sa, sb)
    raises(InputValueError, "b must be column-major", a, b.contiguous(), sa, sb)
    raises(InputValueError, "K and N must be multiples of 16", *operands(n=40))
    raises(InputValueError, r"scale_a \(32, 1\) and scale_b \(1, 48\)", a, b, torch.ones(M, 1), torch.ones(N, 1))
    raises(InputValueError, r"scales must both be per-tensor .* got scale_a \(32,\)", a, b, torch.ones(M), sb)
    raises(InputValueError, "scale_a must be contiguous", a, b, torch.ones(1, M).t(), torch.ones(1, N))
    raises(InputValueError, r"bias must have shape \(48,\)", a, b, sa, sb, bias=torch.zeros(N + 1,
                                                                                             dtype=torch.bfloat16))
    raises(InputValueError, r"out has shape \(32, 49\), expected \(32, 48\)", a, b, sa, sb,
           out=torch.empty(M, N + 1, dtype=torch.bfloat16))
    # the same error types as kernels.mm's for the same fault (kernels.dispatch.out_arg)
    raises(InputTypeError, "out has dtype torch.float32, expected torch.bfloat16", a, b, sa, sb, out=torch.empty(M, N))
    raises(InputValueError, "out has elements that share memory", a, b, sa, sb,
           out=torch.empty(1, N, dtype=torch.bfloat16).expand(M, N))


def test_non_finite_scales_are_refused_on_the_cold_path():
    a, b, _, sb = operands()
    for bad in (float("nan"), float("inf")):
        raises(InputValueError, "scale_a has non-finite values", a, b, torch.tensor(bad), sb)


def test_grad_is_refused_and_devices_must_agree():
    a, b, sa, sb = operands()
    raises(InputValueError, "not differentiable", a, b, sa.clone().requires_grad_(), sb)
    meta = torch.empty(N, K, dtype=E4M3, device="meta").t()
    raises(InputValueError, "on one device", a, meta, sa, sb)


def test_supports_fp8_rules():
    p = problem(m=64, n=64, k=4096, dtype="e4m3", op="scaled_mm", lb="col")
    assert supports(p, "triton_scaled_mm", GemmConfig(64, 64, 64, 3, 4)) == (True, "")
    ok, why = supports(p, "triton_scaled_mm", GemmConfig(64, 64, 16, 3, 4))
    assert not ok and why == "e4m3 dot needs block_k >= 32"
    row_b = problem(m=64, n=64, k=4096, dtype="e4m3", op="scaled_mm")
    ok, why = supports(row_b, "split_k", GemmConfig(64, 64, 64, 3, 4))
    assert not ok and "K-major" in why
    ok, why = supports(p, "triton_mm", GemmConfig(64, 64, 64, 3, 4))
    assert not ok and why == "triton_mm does not implement scaled_mm"


def test_scalings_and_output_dtypes_are_stored_apart():
    p = dataclasses.replace(problem(m=64, n=512, k=512, dtype="e4m3", op="scaled_mm", lb="col"), out_dtype="bf16",
                            scaling="row")
    keys = {p.key(), dataclasses.replace(p, scaling="tensor").key(), dataclasses.replace(p, out_dtype="fp16").key(),
            dataclasses.replace(p, bias=True).key()}
    assert len(keys) == 4 and p.epilogue_operands == 2 and dataclasses.replace(p, bias=True).epilogue_operands == 3


def test_no_out_over_a_scale_or_the_bias_either_warm_or_cold():
    """The warm path takes an out= only where the cold checks would: one sharing memory with the bias (or a scale)
    fails `out_fits` too, so it goes to the cold checks, which refuse it naming the bias."""
    from kernels.dispatch.out_arg import out_fits

    a, b, sa, sb = operands()
    buffer = torch.zeros(M * N, dtype=torch.bfloat16)
    out, over = buffer.view(M, N), buffer[-N:]          # the bias would be out's last row
    apart = torch.zeros(N, dtype=torch.bfloat16)
    assert out_fits(out, a, b, torch.bfloat16, sa, sb, apart) and out_fits(out, a, b, torch.bfloat16, sa, sb, None)
    assert not out_fits(out, a, b, torch.bfloat16, sa, sb, over)
    raises(InputValueError, "out shares memory with bias", a, b, sa, sb, bias=over, out=out)
