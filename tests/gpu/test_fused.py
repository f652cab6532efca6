"""GPU: kernels.patch's fused blocks (RMSNorm, the gated MLP's silu(g) * u) against eager on CUDA, bf16 and fp16:
each kernel forward and backward at a llama width, a patched decoder layer's output and grads, and a CUDA-graph
capture of a patched model whose blocks were checked on a first call."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kernels
from bench.model_def import build_model, model_input
from backends import fused_triton
from kernels.dispatch import fused
from kernels.dispatch.fused import eager_rms_norm, rms_norm, silu_mul
from tests.helpers import output_and_grads


@pytest.fixture(autouse=True)
def aten_only(monkeypatch):
    """the GEMMs through aten: these tests are about the blocks between them; and small inputs fused too"""
    kernels.config.backends = ("aten",)
    monkeypatch.setattr(fused, "FUSE_MIN_ELEMENTS", 1)
    monkeypatch.setattr(fused, "FUSE_MIN_ELEMENTS_NO_GRAD", 1)


def _rel(value, reference):
    return float((value.float() - reference.float()).abs().max() / reference.float().abs().max())


def _eager_norm(x, weight, eps=1e-6):
    return eager_rms_norm(x, weight, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,width", [(1, 4096), (77, 4096), (512, 5120), (64, 11008)])
def test_rms_norm_matches_eager(dtype, m, width):
    torch.manual_seed(0)
    x = torch.randn(m, width, device="cuda", dtype=dtype) * 2
    weight = (1 + 0.1 * torch.randn(width, device="cuda")).to(dtype)
    grad = torch.randn(m, width, device="cuda", dtype=dtype)
    out, (dx, dw) = output_and_grads(lambda a, b: rms_norm(a, b, 1e-6), (x, weight), grad)
    ref, (rdx, rdw) = output_and_grads(_eager_norm, (x, weight), grad)
    tol = 1e-2 if dtype is torch.bfloat16 else 2e-3
    assert _rel(out, ref) < tol and _rel(dx, rdx) < 2 * tol and _rel(dw, rdw) < 2 * tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_matches_eager(dtype):
    torch.manual_seed(0)
    g, u = (torch.randn(333, 11008, device="cuda", dtype=dtype) * 3 for _ in range(2))
    grad = torch.randn_like(g)
    out, (dg, du) = output_and_grads(silu_mul, (g, u), grad)
    ref, (rdg, rdu) = output_and_grads(lambda a, b: F.silu(a) * b, (g, u), grad)
    tol = 1e-2 if dtype is torch.bfloat16 else 2e-3
    assert _rel(out, ref) < tol and _rel(dg, rdg) < 2 * tol and _rel(du, rdu) < 2 * tol


@pytest.mark.gpu
def test_patched_layer_fuses_its_blocks_and_matches_eager_grads():
    base = build_model(1024, 2816, 1, 128, "bf16", "cuda")
    x = model_input(256, 1024, "bf16", "cuda")
    eager, patched = copy.deepcopy(base), kernels.patch(copy.deepcopy(base))
    before = kernels.stats()["fused_blocks"]
    outs = []
    for model in (eager, patched):
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.float().square().mean().backward()
        outs.append((out, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    assert kernels.stats()["fused_blocks"] - before == 3       # two norms and the MLP
    (out_e, dx_e, grads_e), (out_p, dx_p, grads_p) = outs
    assert _rel(out_p, out_e) < 2e-2 and _rel(dx_p, dx_e) < 5e-2
    assert all(_rel(grads_p[n], grads_e[n]) < 5e-2 for n in grads_e)


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True])
def test_small_inputs_on_a_gpu_run_the_modules_own_forward(monkeypatch, grad):
    monkeypatch.setattr(fused, "FUSE_MIN_ELEMENTS" if grad else "FUSE_MIN_ELEMENTS_NO_GRAD", 1 << 20)
    model = kernels.patch(build_model(1024, 2816, 1, 128, "bf16", "cuda"))
    before = kernels.stats()["fused_blocks"]
    with torch.set_grad_enabled(grad):
        model(model_input(64, 1024, "bf16", "cuda"))           # 64 x 1024 elements: below the floor, not fused
        assert kernels.stats()["fused_blocks"] == before
        model(model_input(1024, 1024, "bf16", "cuda"))         # 2^20: fused
    assert kernels.stats()["fused_blocks"] == before + 3


@pytest.mark.gpu
def test_compiled_launches_serve_aligned_misaligned_and_batched_rows():
    """The warm path's binaries (backends.fused_triton): one per specialisation, here an aligned and a misaligned x,
    a 3-D input served without a view, and silu * u, each against eager; launched through Triton's C launcher."""
    torch.manual_seed(0)
    fused_triton._compiled.clear()
    weight = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    base = torch.randn(64, 4096 + 8, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        batched = torch.randn(2, 33, 4096, device="cuda", dtype=torch.bfloat16)
        decode = torch.randn(1, 7, 4096, device="cuda", dtype=torch.bfloat16).transpose(0, 1)   # any size-1 stride
        for x in (base[:, :4096], base[:, 1:4097], batched, decode):
            out = rms_norm(x, weight, 1e-6)
            assert out.shape == x.shape and _rel(out, _eager_norm(x, weight)) < 1e-2
        g, u = torch.randn(2, 3, 11008, device="cuda", dtype=torch.bfloat16).unbind(0)[:2]
        assert _rel(silu_mul(g, u), F.silu(g) * u) < 1e-2
    launches = [v for k, v in fused_triton._compiled.items() if k[1] == torch.cuda.current_device()]
    assert launches and all(v is not None for v in launches)     # triton 3.5-3.6: the C launcher's layout is known
    aligned = {key[-1][0][1] for key in fused_triton._compiled if key[0] is fused_triton.RMSNORM_FORWARD}
    assert aligned == {True, False}


@pytest.mark.gpu
def test_cuda_graph_capture_of_a_patched_model_after_its_first_call():
    model = kernels.patch(build_model(512, 1408, 2, 64, "bf16", "cuda"))
    x = model_input(16, 512, "bf16", "cuda")
    with torch.no_grad():
        reference = model(x)               # the first call checks the blocks (and tunes the products)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, reference)
