"""The custom ops' C++ dispatcher kernels (kernels/native/csrc/fastpath.cpp, register_ops): once the C++ table is
loaded and the ops are defined, kernels::mm / int_mm / linear run through C++ at Autograd<device> and <device>
(the table, and the Python product on a miss), not through torch.library's Python layers. What a user sees must not
change: results, gradients (also twice differentiated), errors by name, torch.compile traces and training steps."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.core.config import interpret_mode
from kernels.core.errors import InputValueError
from kernels.dispatch import api
from kernels.dispatch import ops as kops
from tests.helpers import run_python, served

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

OPS = ("mm", "int_mm", "linear")


@pytest.fixture
def native(fast):
    """The table loaded and the ops defined, so their C++ kernels are bound to this test's copy of the library."""
    kernels.mm(torch.randn(4, 8).half(), torch.randn(8, 4).half())        # a cold call loads the table
    assert api.fastpath_status() == "loaded"
    api._custom.ready()
    assert kops._native == [api._fast.module]
    torch._dynamo.reset()
    yield fast
    torch._dynamo.reset()


def cpp_keys(op: str) -> set[str]:
    """The dispatch keys whose active kernel for kernels::op fastpath.cpp registered (the dump also lists, marked
    "(inactive)", what an earlier test's copy of the library registered and this one overrode)."""
    dump = torch._C._dispatch_dump(f"kernels::{op}")
    return {line.split(":")[0] for line in dump.splitlines()
            if "fastpath.cpp" in line and "(inactive)" not in line.split(":")[0]}


def test_each_op_has_cpp_kernels_at_the_device_and_autograd_keys(native):
    for op in OPS:
        assert cpp_keys(op) == {"CPU", "CUDA", "AutogradCPU", "AutogradCUDA"}, op


def test_a_warm_op_call_is_served_by_the_table_and_a_miss_by_the_product(native):
    x, w, b = torch.randn(6, 8).half(), torch.randn(5, 8).half(), torch.randn(5).half()
    expected = F.silu(F.linear(x.float(), w.float(), b.float())).half()
    tunes = kernels.stats()["tunes"]
    first = torch.ops.kernels.linear(x, w, b, "silu")                      # a miss: the product tunes it
    assert kernels.stats()["tunes"] == tunes + 1
    results = []
    assert served(lambda: results.append(torch.ops.kernels.linear(x, w, b, "silu"))) == 1
    for out in (first, results[0]):
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    x3 = x.view(2, 3, 8)                                                   # 3-D: the op flattens and unflattens
    assert torch.ops.kernels.linear(x3, w, b, "silu").shape == (2, 3, 5)
    a8, b8 = torch.randint(-8, 8, (32, 16), dtype=torch.int8), torch.randint(-8, 8, (16, 24), dtype=torch.int8)
    assert torch.equal(torch.ops.kernels.int_mm(a8, b8), torch._int_mm(a8, b8))
    a, m = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    assert served(lambda: results.append(torch.ops.kernels.mm(a, m))) == 1
    torch.testing.assert_close(results[-1], a @ m)


def test_bad_input_through_the_cpp_kernels_raises_the_named_error(native):
    x = torch.randn(4, 8)
    with pytest.raises(InputValueError, match="in_features 7"):
        torch.ops.kernels.linear(x, torch.randn(6, 7), None, None)
    with pytest.raises(InputValueError, match="unknown activation 'tanh'"):
        torch.ops.kernels.linear(x, torch.randn(6, 8), None, "tanh")
    with pytest.raises(TypeError, match="dtype"):
        torch.ops.kernels.mm(x.double(), torch.randn(8, 3).double())
    # and the table goes on serving after an error left through it
    a, m = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, m)
    assert served(lambda: torch.ops.kernels.mm(a, m)) == 1


def test_grads_through_the_autograd_kernel_match_torch_also_twice(native):
    torch.manual_seed(0)
    x, w, b = torch.randn(6, 8), torch.randn(5, 8), torch.randn(5)
    mine = [t.clone().requires_grad_() for t in (x, w, b)]
    ref = [t.clone().requires_grad_() for t in (x, w, b)]
    out = torch.ops.kernels.linear(*mine, "gelu")
    assert type(out.grad_fn).__name__ == "_TracedLinearBackward"
    out.square().sum().backward()
    F.gelu(F.linear(*ref), approximate="tanh").square().sum().backward()
    for got, want in zip(mine, ref):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)
    # mm's backward runs the op again, so the second derivative goes through the same kernels
    a, m = torch.randn(5, 3, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    a2, m2 = a.detach().clone().requires_grad_(), m.detach().clone().requires_grad_()
    (ga,) = torch.autograd.grad(torch.ops.kernels.mm(a, m).square().sum(), a, create_graph=True)
    (ga2,) = torch.autograd.grad((a2 @ m2).square().sum(), a2, create_graph=True)
    torch.testing.assert_close(ga, ga2, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.autograd.grad(ga.sum(), m)[0], torch.autograd.grad(ga2.sum(), m2)[0],
                               rtol=1e-4, atol=1e-4)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def test_a_compiled_training_step_through_the_cpp_kernels_matches_eager(native):
    model, x = Mlp(), torch.randn(3, 5, 16)
    reference = Mlp()
    compiled = torch.compile(kernels.patch(model), fullgraph=True, backend="aot_eager")
    for _ in range(2):                                          # the second step runs warm
        model.zero_grad()
        reference.zero_grad()
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
        for got, want in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-4)


def test_inductor_inference_graph_calls_are_served_by_the_table(native):
    model = kernels.patch(Mlp().half())
    x = torch.randn(4, 16).half()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        first = compiled(x)                                    # traces, compiles, and tunes both products
        results = []
        assert served(lambda: results.append(compiled(x))) == 2
    torch.testing.assert_close(results[0], first)
    kernels.unpatch(model)
    with torch.no_grad():
        torch.testing.assert_close(first, model(x), rtol=2e-2, atol=2e-2)


def test_the_kernels_bind_whichever_comes_last_the_ops_or_the_table(native):
    """A fresh process, both orders: the library loaded before the ops are defined, and after."""
    code = """
import torch, kernels
from kernels.dispatch import api
from kernels.dispatch import ops as kops
first = "{first}"
if first == "table":
    assert api.load_fastpath() == "loaded" and not kops._native
    api._custom.ready()
else:
    api._custom.ready()
    assert not kops._native
    assert api.load_fastpath() == "loaded"
assert kops._native == [api._fast.module]
dump = torch._C._dispatch_dump("kernels::linear")
assert "AutogradCPU: registered at" in dump and "fastpath.cpp" in dump, dump
x, w = torch.randn(4, 8).half(), torch.randn(6, 8).half()
torch.testing.assert_close(torch.ops.kernels.linear(x, w, None, "relu"), torch.relu(x @ w.t()))
print("ok")
"""
    for first in ("table", "ops"):
        proc = run_python(code.replace("{first}", first), env={"KERNELS_BACKENDS": "aten", "KERNELS_FASTPATH": "auto",
                                                               "KERNELS_CACHE_DIR": str(native.folder.parent.parent)},
                          timeout=300)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (first, proc.stderr[-3000:])


def test_a_miss_met_eagerly_inside_a_compiled_function_is_not_traced_by_dynamo(native):
    """The C++ kernels call kernels' Python product on a miss; with a compile frame callback active (a compiled
    function's eager part), Dynamo must not start tracing kernels' own frames (as torch.library keeps it from its own
    Python kernels): as many frames as with torch.mm there."""
    from torch._dynamo.utils import counters

    w = torch.randn(8, 4)

    def frames(product) -> int:
        @torch.compiler.disable(recursive=False)
        def eager_part(x):
            return product(x, w)

        def f(x):
            return eager_part(x * 2) + 1

        torch._dynamo.reset()
        counters.clear()
        torch.testing.assert_close(torch.compile(f, backend="eager")(torch.ones(4, 8)), torch.ones(4, 8) * 2 @ w + 1)
        return counters["frames"]["total"]

    assert frames(torch.ops.kernels.mm) == frames(torch.mm)
