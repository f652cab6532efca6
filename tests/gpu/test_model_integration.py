"""GPU: a model through kernels — kernels.patch forward and backward against torch (bf16/fp16), torch.compile
(fullgraph) over a patched module, kernels.enabled() routing torch.mm/matmul/addmm, and a CUDA-graph capture of a
patched model's warm forward."""
import copy

import pytest
import torch
import torch.nn.functional as F

import kernels
from tests.helpers import served


@pytest.fixture(autouse=True)
def no_cutlass():
    """aten and Triton only: a fresh cache would start the CUTLASS set's background build on every core."""
    kernels.config.backends = ("aten", "triton")


def _mlp(dtype, bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512, bias=bias), torch.nn.SiLU(), torch.nn.Linear(512, 128),
                               ).to("cuda", dtype)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_patched_mlp_forward_and_grads_match_torch(dtype):
    ref = _mlp(dtype)
    ours = kernels.patch(copy.deepcopy(ref))
    x = torch.randn(3, 64, 256, device="cuda", dtype=dtype)
    before = kernels.stats()["tunes"]
    for model in (ref, ours):
        model.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
    assert kernels.stats()["tunes"] > before             # forward and backward products were tuned
    with torch.no_grad():
        assert _rel(ours(x), ref(x)) < 2e-2
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 3e-2, name
    kernels.unpatch(ours)


@pytest.mark.gpu
def test_an_all_aten_layer_trains_through_torchs_autograd_served_by_the_table(fast):
    """aten as the only backend (the `fast` fixture: the C++ table built and on): a patched layer's grad calls are
    torch's own F.linear after the first, served by the C++ table (at::linear under grad mode) on CUDA, and its grads
    are torch's."""
    kernels.clear_memory_cache()                          # routes kept by earlier tests would be other backends'
    assert kernels.load_fastpath(wait=True) == "loaded"
    ref = _mlp(torch.bfloat16, bias=False)
    ours = kernels.patch(copy.deepcopy(ref))
    x = torch.randn(2, 32, 256, device="cuda", dtype=torch.bfloat16)
    before = kernels.stats()["torch_autograd"]
    ours(x)                                               # the first calls work the routes out
    assert kernels.stats()["torch_autograd"] - before == 2
    out = []
    assert served(lambda: out.append(ours(x))) == 2       # both layers' grad calls
    out[-1].float().square().mean().backward()
    ref(x).float().square().mean().backward()
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name          # the same torch calls, the same grads


@pytest.mark.gpu
def test_compiled_patched_module_has_no_graph_break():
    model = kernels.patch(_mlp(torch.bfloat16))
    x = torch.randn(32, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
        assert _rel(out, kernels.unpatch(copy.deepcopy(model))(x)) < 2e-2


@pytest.mark.gpu
def test_enabled_routes_torch_functions_on_cuda():
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(96, device="cuda", dtype=torch.bfloat16)
    before = kernels.stats()
    with kernels.enabled():
        outs = [torch.mm(a, b), a @ b, torch.addmm(bias, a, b), F.linear(a, b.t(), bias),
                torch.matmul(a.view(2, 32, 128), b)]
        passed = torch.mm(a.double(), b.double())             # fp64: passes through, counted
    assert kernels.stats()["tunes"] > before["tunes"]
    assert kernels.stats()["passthroughs"] == before.get("passthroughs", 0) + 1
    ref = a.double() @ b.double()
    for out, want in zip(outs, [ref, ref, ref + bias.double(), ref + bias.double(), ref.view(2, 32, 96)]):
        assert _rel(out, want) < 1e-2
    assert passed.dtype == torch.float64


@pytest.mark.gpu
def test_cuda_graph_captures_a_patched_model():
    model = kernels.patch(_mlp(torch.bfloat16))
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(stream):
        model(x)                         # tunes, outside the capture
        model(x)                         # warm on the capture stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = model(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    with torch.no_grad():
        assert _rel(out, kernels.unpatch(copy.deepcopy(model))(x)) < 2e-2


@pytest.mark.gpu
def test_a_compiled_patched_model_runs_through_the_ops_cpp_kernels(fast):
    """With the C++ table loaded, the compiled graph's kernels::linear calls are served by it through the ops' C++
    dispatcher kernels (Inductor, and CUDA-graph trees), and a compiled training step's grads are torch's."""
    kernels.config.backends = ("aten", "triton")
    assert kernels.load_fastpath(wait=True) == "loaded"
    model = kernels.patch(_mlp(torch.bfloat16))
    ref = kernels.unpatch(copy.deepcopy(model))
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        compiled(x)                                       # traces, compiles, tunes both products
        out = []
        assert served(lambda: out.append(compiled(x))) == 2
        assert _rel(out[0], ref(x)) < 2e-2
        graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for _ in range(3):                                # warm-up, record, replay
            y = graphed(x)
        assert _rel(y.clone(), ref(x)) < 2e-2
    torch._dynamo.reset()
    train = torch.compile(model, fullgraph=True)
    train(x).float().square().mean().backward()
    ref(x).float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad, q.grad) < 3e-2, name


@pytest.mark.gpu
def test_cuda_graph_trees_take_a_winner_that_keeps_a_workspace(monkeypatch):
    """torch.compile(mode="reduce-overhead") over a patched layer whose winner keeps a per-stream workspace
    (split-K): the workspace is made outside the graph trees' memory pool, so they accept it, and replays are right."""
    monkeypatch.setenv("KERNELS_ONLY", "split_k")
    kernels.config.reset()
    kernels.config.backends = ("triton",)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4096, 256, bias=False).to("cuda", torch.bfloat16)
    ref = copy.deepcopy(layer)
    model = kernels.patch(layer)
    x = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    with torch.no_grad():
        assert kernels.explain(x, model.weight, op="linear").winner.startswith("split_k")
        graphed = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        for step in range(4):                             # warm-up, record, replays
            torch.compiler.cudagraph_mark_step_begin()
            x.copy_(torch.randn_like(x))
            y = graphed(x)
            assert _rel(y.clone(), ref(x)) < 2e-2, step
    torch._dynamo.reset()
