"""torch.compile over modules that call kernels.linear and kernels.mm: one graph (fullgraph=True, no break), the
products in it as the custom ops kernels::linear / kernels::mm, results and gradients as in eager."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.core.config import interpret_mode
from kernels.dispatch import api
from tests.helpers import run_python, served

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


@pytest.fixture(autouse=True)
def small_space(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,triton")
    kernels.config.reset()
    kernels.config.benchmark_space = 1
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    """A gated MLP on 3-D activations: kernels.linear with bias and activation, then kernels.mm on the flattened
    result."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 24)
        self.gate = torch.nn.Parameter(torch.randn(24, 8) / 5)

    def forward(self, x):
        h = kernels.linear(x, self.up.weight, self.up.bias, activation="gelu")
        return kernels.mm(h.reshape(-1, 24), self.gate).reshape(*x.shape[:-1], 8)


def eager_reference(block, x):
    h = F.gelu(F.linear(x, block.up.weight, block.up.bias), approximate="tanh")
    return (h.reshape(-1, 24) @ block.gate).reshape(*x.shape[:-1], 8)


class GraphRecorder:
    """A torch.compile backend that keeps each graph Dynamo hands it (one per graph break + 1), then runs it."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def calls(self):
        return [(n.target, n.args) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"]


def test_fullgraph_traces_the_custom_ops_fused_for_inference():
    block, x = Block(), torch.randn(2, 5, 16)
    recorder = GraphRecorder()
    compiled = torch.compile(block, fullgraph=True, backend=recorder)
    with torch.no_grad():
        out = compiled(x)
    torch.testing.assert_close(out, eager_reference(block, x), rtol=1e-4, atol=1e-4)
    assert len(recorder.graphs) == 1
    targets = [t for t, _ in recorder.calls()]
    assert torch.ops.kernels.mm.default in targets or torch.ops.kernels.mm in targets
    # no autograd: the activation is fused into the one linear op
    linear_args = [args for t, args in recorder.calls()
                   if t in (torch.ops.kernels.linear, torch.ops.kernels.linear.default)]
    assert len(linear_args) == 1 and linear_args[0][-1] == "gelu"


def test_fullgraph_training_step_matches_eager_grads():
    block, x = Block(), torch.randn(2, 5, 16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    tunes = kernels.stats()["tunes"]
    compiled(x).square().sum().backward()
    got = [p.grad.clone() for p in block.parameters()]
    assert kernels.stats()["tunes"] > tunes              # the graph's ops ran kernels' products, tuned here
    block.zero_grad()
    eager_reference(block, x).square().sum().backward()
    for g, p in zip(got, block.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)


def test_explain_reports_no_graph_break_for_a_patched_model():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 4))
    kernels.patch(model)
    x = torch.randn(3, 16)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_a_traced_bad_input_raises_the_named_error():
    def f(x, w):
        return kernels.linear(x, w, activation="tanh")

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="unknown activation 'tanh'"):
        torch.compile(f, backend="aot_eager")(x, w)              # the trace stops there; eager raises the error
    torch._dynamo.reset()                                        # (Dynamo remembers f's frame as one to skip)
    with pytest.raises(RuntimeError, match="unknown activation 'tanh'"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)     # Dynamo's error, carrying ours


def test_default_backend_compiles_and_matches():
    """Inductor (the default backend) on CPU: the custom ops stay extern calls into kernels."""
    block, x = Block(), torch.randn(2, 5, 16)
    with torch.no_grad():
        out = torch.compile(block, fullgraph=True)(x)
    torch.testing.assert_close(out, eager_reference(block, x), rtol=1e-4, atol=1e-4)


def test_with_the_cpp_table_loaded_warm_calls_stay_there_and_grad_or_traced_calls_leave_it(fast):
    a, b = torch.randn(8, 16).half(), torch.randn(16, 4).half()
    kernels.mm(a, b)                                        # tuned; the C++ table serves it from now on
    assert api.fastpath_status() == "loaded"
    results = []
    assert served(lambda: results.append(kernels.mm(a, b))) == 1 and results[-1].grad_fn is None
    a.requires_grad_()
    # the table declines a call autograd needs; aten won the product and its backward ones here, so the call is
    # torch.mm itself under torch's autograd (with a kernel of kernels' winning: tests/interp/test_autograd.py)
    winner = kernels.explain(a, b).winner
    assert served(lambda: results.append(kernels.mm(a, b))) == 0
    assert winner.startswith("aten") and type(results[-1].grad_fn).__name__ == "MmBackward0"
    assert torch.equal(results[-1], results[0])
    a.requires_grad_(False)
    compiled = torch.compile(lambda x, y: kernels.mm(x, y) * 2, fullgraph=True, backend="aot_eager")
    assert served(lambda: results.append(compiled(a, b))) == 1     # the graph's op runs the plain, warm product
    torch.testing.assert_close(results[-1], results[0] * 2)


def test_first_call_of_a_process_may_be_a_traced_one():
    """Nothing registered the ops before the trace reaches kernels.linear: registration happens then (first use)."""
    code = """
import torch, kernels
assert not hasattr(torch.ops.kernels, "linear")
def f(x, w, b):
    return kernels.mm(kernels.linear(x, w, b, activation="relu"), w)
x, w, b = torch.randn(4, 8), torch.randn(8, 8), torch.randn(8)
out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, b)
torch.testing.assert_close(out, torch.relu(x @ w.t() + b) @ w, rtol=1e-4, atol=1e-4)
print("ok")
"""
    proc = run_python(code, env={"KERNELS_BACKENDS": "aten", "KERNELS_FASTPATH": "off"}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_importing_kernels_registers_nothing():
    code = ("import torch, kernels; kernels.mm; kernels.linear; kernels.patch; kernels.enabled\n"
            "print(hasattr(torch.ops.kernels, 'mm'), hasattr(torch.ops.kernels, 'linear'))")
    proc = run_python(code, env={"KERNELS_FASTPATH": "off"}, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "False False", proc.stdout + proc.stderr[-3000:]


def test_torch_jit_trace_records_the_custom_ops_and_replays_them():
    """torch.jit.trace records torch ops, not kernel launches: a traced call is the custom op (one node), so the
    traced module computes on new inputs (it raised inside the tuner, on sizes the tracer hands as tensors)."""
    block, model = Block(), kernels.patch(torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU()))
    x, later = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.no_grad():
        traced_block = torch.jit.trace(block, (x,), check_trace=False)
        traced_model = torch.jit.trace(model, (x,), check_trace=False)
        ints = torch.jit.trace(kernels.int_mm, (torch.ones(32, 32, dtype=torch.int8),) * 2, check_trace=False)
        torch.testing.assert_close(traced_block(later), eager_reference(block, later), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(traced_model(later), F.relu(F.linear(later, model[0].weight, model[0].bias)),
                                   rtol=1e-4, atol=1e-4)
    a8, b8 = torch.randint(-8, 8, (32, 32), dtype=torch.int8), torch.randint(-8, 8, (32, 32), dtype=torch.int8)
    assert torch.equal(ints(a8, b8), a8.int() @ b8.int())
    assert "kernels::mm" in str(traced_block.graph) and "kernels::int_mm" in str(ints.graph)
