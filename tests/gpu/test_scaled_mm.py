"""GPU: fp8 scaled_mm in every Triton family built directly (both scalings, a bias, each output dtype, odd shapes:
M = 1 and 17, K = 4096 + 16), against the float64 product of the dequantized inputs; the tuned kernels.scaled_mm
against torch._scaled_mm, its warm call, and a CUDA-graph capture of one."""
import pytest
import torch

import kernels
from backends.triton import TritonBackend
from backends.triton_templates import family
from kernels.core.problem import GemmProblem
from kernels.measure.verify import check, make_inputs, reference

E4M3 = torch.float8_e4m3fn
FAMILIES = ("triton_scaled_mm", "triton_tma_scaled_mm", "split_k")
# (m, n, k): skinny (split-K territory), odd M, K off the 128-multiple grid, and a square one
SHAPES = [(1, 4096, 4096), (17, 1024, 4096 + 16), (64, 4096, 11008), (1024, 1024, 1024)]
# (scaling, bias, output dtype)
EPILOGUES = [("tensor", False, "bf16"), ("row", False, "bf16"), ("row", True, "fp16"), ("tensor", True, "fp32")]


@pytest.fixture(autouse=True)
def no_cutlass():
    """aten and Triton only: a fresh cache would start the CUTLASS set's background build on every core."""
    kernels.config.backends = ("aten", "triton")


def scaled_problem(m, n, k, scaling, bias, out_dtype, dtype=E4M3) -> GemmProblem:
    a = torch.empty(m, k, dtype=dtype, device="cuda")
    b = torch.empty(n, k, dtype=E4M3, device="cuda").t()
    return GemmProblem.from_tensors("scaled_mm", a, b, bias=bias, scaling=scaling, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("template", FAMILIES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_family_scales_and_adds_the_bias(template, m, n, k):
    built = 0
    for scaling, bias, out_dtype in EPILOGUES:
        p = scaled_problem(m, n, k, scaling, bias, out_dtype)
        choices, skipped = family(template).choices(p, template, "default")
        if not choices:
            continue
        # the first and the last offered: a small and a large tile of the list
        for outcome in TritonBackend().build(p, [choices[0], choices[-1]]):
            assert outcome.runner is not None, outcome.error
            operands = make_inputs(p, "cuda", seed=built)
            ref = reference(p, *operands)
            for _ in range(2 if template == "split_k" else 1):      # split-K's workspace must stay clean
                result = check(p, outcome.runner.launch(*operands), ref)
                assert result.ok, (outcome.choice.name, scaling, bias, out_dtype, result.message)
            built += 1
    if not built:
        pytest.skip(f"{template} offers nothing for {m}x{n}x{k}")


@pytest.mark.gpu
def test_e5m2_times_e4m3():
    p = scaled_problem(256, 512, 1024, "row", False, "bf16", dtype=torch.float8_e5m2)
    for template in ("triton_scaled_mm", "triton_tma_scaled_mm"):
        choices, _ = family(template).choices(p, template, "default")
        (outcome,) = TritonBackend().build(p, choices[:1])
        assert outcome.runner is not None, outcome.error
        operands = make_inputs(p, "cuda", seed=1)
        assert check(p, outcome.runner.launch(*operands), reference(p, *operands)).ok, outcome.choice.name


@pytest.mark.gpu
@pytest.mark.parametrize("m,scaling", [(16, "row"), (512, "tensor")])
def test_tuned_scaled_mm_matches_torch_and_captures(m, scaling):
    torch.manual_seed(0)
    n, k = 4096, 4096
    a = torch.randn(m, k, device="cuda").to(E4M3)
    w = torch.randn(n, k, device="cuda").to(E4M3)
    if scaling == "row":
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    else:
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(1.5, device="cuda")
    bias = torch.randn(n, device="cuda").to(torch.bfloat16)
    out = kernels.scaled_mm(a, w.t(), sa, sb, bias=bias)
    expected = torch._scaled_mm(a, w.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16)
    assert float((out.float() - expected.float()).norm() / expected.float().norm()) < 1e-2
    sel = kernels.explain(a, w.t(), op="scaled_mm", scale_a=sa, scale_b=sb, bias=bias)
    assert sel.winner in sel.timings and isinstance(sel.timings[sel.winner], float)
    hits = kernels.stats()["memory_hits"]
    kernels.scaled_mm(a, w.t(), sa, sb, bias=bias)
    assert kernels.stats()["memory_hits"] == hits + 1
    # a warm call captured in a CUDA graph replays the same product on new scales written in place
    static = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        kernels.scaled_mm(a, w.t(), sa, sb, bias=bias, out=static)
    sa.mul_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    again = torch._scaled_mm(a, w.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16)
    assert float((static.float() - again.float()).norm() / again.float().norm()) < 1e-2

