"""GPU: kernels.linear's epilogue in every Triton family built directly (bf16/fp16, each activation, with and without
a bias, shapes where each family is offered), the tuned kernels.linear against F.linear, and a CUDA-graph capture of
a warm call."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import kernels
from backends.triton import TritonBackend
from backends.triton_templates import family
from kernels.core.problem import GemmProblem
from tests.triton_helpers import cuda_operand

ACT = {"": lambda z: z, "relu": torch.relu, "gelu": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}
# (template, m, n, k, layout of B): where each family is offered (split-K: small M*N, long K; padded: misaligned K)
OFFERED = [("triton_mm", 300, 200, 128, "col"), ("triton_tma_mm", 512, 512, 512, "row"),
           ("split_k", 32, 32, 4096, "col"), ("decompose_k", 32, 32, 8192, "row"),
           ("triton_padded_mm", 2047, 2047, 2047, "row"), ("triton_padded_tma_mm", 2047, 2047, 2047, "row")]


def _rel(out, ref):
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def no_cutlass():
    """aten and Triton only: a fresh cache would start the CUTLASS set's background build on every core."""
    kernels.config.backends = ("aten", "triton")


# three epilogues per family (the interpreter tests cover all eight on CPU): an activation alone, bias + activation,
# bias alone; bf16 everywhere, fp16 on the tiled kernel and split-K
EPILOGUES = [(False, "silu"), (True, "gelu"), (True, "relu"), (True, "")]


@pytest.mark.gpu
@pytest.mark.parametrize("template,m,n,k,lb,dtype", [(*case, torch.bfloat16) for case in OFFERED] +
                         [(*case, torch.float16) for case in OFFERED if case[0] in ("triton_mm", "split_k")])
def test_every_family_fuses_the_epilogue(template, m, n, k, lb, dtype):
    a, b = cuda_operand(m, k, "row", dtype), cuda_operand(k, n, lb, dtype)
    bias = torch.randn(n, device="cuda").to(dtype)
    for has_bias, act in EPILOGUES:
        p = dataclasses.replace(GemmProblem.from_tensors("mm", a, b), bias=has_bias, activation=act)
        choices, skipped = family(template).choices(p, template, "default")
        if not choices:
            pytest.skip(f"{template} not offered: {skipped}")
        (outcome,) = TritonBackend().build(p, choices[:1])
        assert outcome.runner is not None, outcome.error
        ops = (a, b, bias) if has_bias else (a, b)
        ref = ACT[act](a.double() @ b.double() + (bias.double() if has_bias else 0))
        for _ in range(3 if template == "split_k" else 1):       # split-K's workspace must stay clean
            out = outcome.runner.launch(*ops, None)
            assert _rel(out, ref) < 1e-2, (outcome.choice.name, has_bias, act)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [16, 200])
def test_tuned_linear_matches_f_linear(m):
    x = torch.randn(2, m, 1024, device="cuda", dtype=torch.bfloat16)
    lin = torch.nn.Linear(1024, 768, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for act in (None, "gelu"):
            ref = ACT[act or ""](F.linear(x.double(), lin.weight.double(), lin.bias.double()))
            for _ in range(2):
                out = kernels.linear(x, lin.weight, lin.bias, activation=act)
                assert out.shape == (2, m, 768) and _rel(out, ref) < 1e-2


@pytest.mark.gpu
def test_cuda_graph_captures_a_warm_linear():
    x = torch.randn(16, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, device="cuda", dtype=torch.bfloat16)
    kernels.linear(x, w, b, activation="silu")          # tunes outside the capture
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernels.linear(x, w, b, activation="silu")      # warm on the capture stream (per-stream workspaces)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = kernels.linear(x, w, b, activation="silu")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    ref = F.silu(F.linear(x.double(), w.double(), b.double()))
    assert _rel(out, ref) < 1e-2



@pytest.mark.gpu
def test_autocast_vmap_and_nan_reach_torchs_answers_whatever_wins():
    """Three things where the winner used to decide the answer: under autocast (bf16) a Triton winner returned
    fp32; under torch.func.vmap the call failed on a missing data pointer; a fused relu turned NaN into 0."""
    kernels.config.backends = ("triton",)              # a Triton winner, whatever aten would do
    x = torch.randn(64, 256, device="cuda")
    w, bias = torch.randn(128, 256, device="cuda"), torch.randn(128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, ref = kernels.linear(x, w, bias), F.linear(x, w, bias)
        got_mm = kernels.mm(x, w.t())
    assert got.dtype == ref.dtype == got_mm.dtype == torch.bfloat16
    assert _rel(got, ref.double()) < 1e-2
    xs = torch.randn(4, 16, 256, device="cuda")
    torch.testing.assert_close(torch.vmap(lambda xi: kernels.linear(xi, w))(xs), xs @ w.t(), rtol=2e-2, atol=2e-2)
    xh, wh, bh = x.half(), w.half(), bias.half()
    xh[0, 0] = float("nan")
    out = kernels.linear(xh, wh, bh, activation="relu")
    assert out[0].isnan().all() and not out[1:].isnan().any()
