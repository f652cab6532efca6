"""kernels.mm and kernels.linear under autograd, on CPU through the tuner (TRITON_INTERPRET=1): gradients match
torch's, and the backward products (dX = dY·W, dW = dYᵀ·X) are kernels products, each tuned as its own problem."""
import pytest
import torch
import torch.nn.functional as F

import kernels
from kernels.dispatch import api
from kernels.core.config import interpret_mode

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

ACT = {None: lambda z: z, "relu": torch.relu, "gelu": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}
TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.fixture(autouse=True)
def small_space(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,triton")
    kernels.config.reset()
    kernels.config.benchmark_space = 1          # the performance model's top pick per backend: a fast tune


def leaves(*shapes, dtype, seed=0):
    torch.manual_seed(seed)
    return [torch.randn(*s, dtype=torch.float32).to(dtype).requires_grad_() for s in shapes]


def grads_of(loss_fn, tensors):
    for t in tensors:
        t.grad = None
    loss_fn().backward()
    return [t.grad for t in tensors]


def reference_grads(loss_fn, tensors):
    """The same loss on float64 copies: what the kernels gradients are held to."""
    doubles = [t.detach().double().requires_grad_() for t in tensors]
    return grads_of(lambda: loss_fn(*doubles), doubles)


def assert_grads_close(got, want, dtype):
    for g, w in zip(got, want):
        assert g is not None and g.dtype == dtype
        torch.testing.assert_close(g.double(), w, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mm_grads_match_torch_and_each_backward_product_is_tuned(dtype):
    a, b = leaves((17, 24), (24, 9), dtype=dtype)
    upstream = torch.randn(17, 9, dtype=torch.float64)       # a non-uniform dY, so dA and dB are real products
    before = kernels.stats()["tunes"]
    got = grads_of(lambda: (kernels.mm(a, b).double() * upstream).sum(), [a, b])
    # the forward, dA = dY·Bᵀ (17x24, k=9) and dB = Aᵀ·dY (24x9, k=17): three problems, three tunes
    assert kernels.stats()["tunes"] - before == 3
    assert_grads_close(got, reference_grads(lambda x, y: ((x @ y) * upstream).sum(), [a, b]), dtype)


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_grads_match_torch(activation, dtype):
    x, w, b = leaves((2, 5, 16), (12, 16), (12,), dtype=dtype)
    upstream = torch.randn(2, 5, 12, dtype=torch.float64)

    def loss(x, w, b, lin=kernels.linear):
        return (lin(x, w, b, activation=activation).double() * upstream).sum()

    got = grads_of(lambda: loss(x, w, b), [x, w, b])
    want = reference_grads(lambda x, w, b: (ACT[activation](F.linear(x, w, b)) * upstream).sum(), [x, w, b])
    assert_grads_close(got, want, dtype)


def test_grad_fn_is_kernels_own_where_a_product_is_not_aten_and_no_grad_stays_plain():
    """Eager calls that need grad, with a Triton winner, record kernels' autograd Functions (the custom ops are what
    torch.compile traces: tests/interp/test_compile.py); no_grad calls record nothing."""
    kernels.config.backends = ("triton",)
    x, w = leaves((8, 16), (4, 16), dtype=torch.float32)
    assert "EagerLinear" in type(kernels.linear(x, w).grad_fn).__name__
    assert "EagerMm" in type(kernels.mm(x, w.t()).grad_fn).__name__
    with torch.no_grad():
        assert kernels.linear(x, w).grad_fn is None and kernels.mm(x, w.t()).grad_fn is None
    # under autograd the activation is torch's (not fused): autograd differentiates it from its own saved input
    assert "Gelu" in type(kernels.linear(x, w, activation="gelu").grad_fn).__name__


def test_all_aten_products_hand_grad_calls_to_torchs_own_autograd():
    """aten won the forward and both backward products: the call is torch's own (its autograd, its host cost), and
    the warm calls after the first look nothing up again."""
    kernels.config.backends = ("aten",)
    x, w, bias = leaves((3, 5, 16), (6, 16), (6,), dtype=torch.float32, seed=2)
    a, b = leaves((9, 16), (16, 7), dtype=torch.float32, seed=3)
    before = kernels.stats()
    out, prod = kernels.linear(x, w, bias, activation="silu"), kernels.mm(a, b)
    assert graph_of(out) >= {"SiluBackward0", "AddmmBackward0"} and graph_of(prod) == {"MmBackward0"}
    assert not any("Eager" in name for name in graph_of(out) | graph_of(prod))
    middle = kernels.stats()
    assert middle["tunes"] - before["tunes"] == 6           # linear, its dX and dW; mm, its dA and dB
    for _ in range(3):
        kernels.linear(x, w, bias, activation="silu")
        kernels.mm(a, b)
    after = kernels.stats()
    assert after["tunes"] == middle["tunes"] and after["memory_hits"] - middle["memory_hits"] == 6

    def loss(x, w, bias, a, b, lin=kernels.linear, mm=kernels.mm):
        return lin(x, w, bias, activation="silu").sum() + mm(a, b).square().sum()

    want = reference_grads(lambda *t: loss(*t, lin=lambda x, w, bias, activation: F.silu(F.linear(x, w, bias)),
                                           mm=torch.mm), [x, w, bias, a, b])
    assert_grads_close(grads_of(lambda: loss(x, w, bias, a, b), [x, w, bias, a, b]), want, torch.float32)


def graph_of(t: torch.Tensor) -> set[str]:
    """The class names of every autograd node behind t."""
    names, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None:
            names.add(type(node).__name__)
            todo.extend(next_fn for next_fn, _ in node.next_functions)
    return names - {"AccumulateGrad"}


def test_a_grad_route_is_kept_per_pattern_of_inputs_needing_grad():
    """A frozen weight (only x needs grad) and a trained one are routed apart: the first looks up no dW product."""
    kernels.config.backends = ("aten",)
    torch.manual_seed(4)
    x = torch.randn(10, 12, requires_grad=True)
    w = torch.randn(5, 12)
    before = kernels.stats()["tunes"]
    kernels.linear(x, w).sum().backward()
    assert kernels.stats()["tunes"] - before == 2           # the forward and dX
    w.requires_grad_()
    kernels.linear(x, w).sum().backward()
    assert kernels.stats()["tunes"] - before == 3           # dW now
    torch.testing.assert_close(w.grad, x.detach().sum(0).expand(5, 12))


def test_bias_only_training_gets_a_bias_grad():
    """Only the bias requires grad (BitFit-style fine-tuning): the call still goes through autograd, warm or cold."""
    torch.manual_seed(0)
    x, w = torch.randn(6, 8), torch.randn(5, 8)
    b = torch.zeros(5, requires_grad=True)
    with torch.no_grad():
        kernels.linear(x, w, b)                 # the plain problem warm first: the grad call must not take it
    kernels.linear(x, w, b).sum().backward()
    torch.testing.assert_close(b.grad, torch.full((5,), 6.0))


def test_bias_grad_is_a_row_sum_accumulated_in_fp32():
    torch.manual_seed(0)
    x = torch.randn(512, 8).half()
    w = torch.randn(4, 8).half()
    b = torch.zeros(4, dtype=torch.float16, requires_grad=True)
    upstream = (torch.rand(512, 4) + 1).half()               # 512 positive halves: an fp16 running sum would drift
    kernels.linear(x, w, b).backward(upstream)
    want = upstream.double().sum(0)
    torch.testing.assert_close(b.grad.double(), want.half().double(), rtol=0, atol=0)


def test_small_mlp_loss_grads_match_torch():
    torch.manual_seed(0)
    params = leaves((32, 16), (32,), (8, 32), (8,), dtype=torch.float32, seed=1)
    x, target = torch.randn(2, 6, 16), torch.randn(2, 6, 8)

    def mlp(lin, x, w1, b1, w2, b2):
        return F.mse_loss(lin(lin(x, w1, b1, activation="silu"), w2, b2), target)

    got = grads_of(lambda: mlp(kernels.linear, x, *params), params)
    want = reference_grads(lambda *p: mlp(lambda x, w, b, activation=None: ACT[activation](F.linear(x, w, b)),
                                          x.double(), *p), params)
    assert_grads_close(got, want, torch.float32)


def test_backward_products_run_on_triton_kernels():
    """Triton alone (no aten candidate): every product of the forward and the backward is a Triton kernel's."""
    kernels.config.backends = ("triton",)
    a, b = leaves((20, 32), (32, 12), dtype=torch.float16)
    x, w, bias = leaves((3, 4, 32), (12, 32), (12,), dtype=torch.float16, seed=1)
    before = kernels.stats()
    loss = lambda a, b, x, w, bias, mm=kernels.mm, lin=kernels.linear: (   # noqa: E731
        mm(a, b).double().square().sum() + lin(x, w, bias, activation="relu").double().square().sum())
    got = grads_of(lambda: loss(a, b, x, w, bias), [a, b, x, w, bias])
    after = kernels.stats()
    # mm, its dA and dB; linear (bias epilogue, relu by torch), its dX and dW (the bias grad is a reduction)
    assert after["tunes"] - before["tunes"] == 6 and after["benchmarks"] > before["benchmarks"]
    want = reference_grads(lambda a, b, x, w, bias: loss(a, b, x, w, bias, mm=torch.mm, lin=lambda x, w, bias,
                                                          activation: torch.relu(F.linear(x, w, bias))),
                           [a, b, x, w, bias])
    assert_grads_close(got, want, torch.float16)


def test_the_op_called_fused_still_differentiates():
    """torch.ops.kernels.linear with an activation, called directly under autograd: its backward recomputes the
    pre-activation product (kernels.linear itself never calls it so)."""
    x, w, b = leaves((6, 16), (8, 16), (8,), dtype=torch.float32)
    api._custom.ready()                           # registers the ops (a traced call would, on its first use)
    got = grads_of(lambda: torch.ops.kernels.linear(x, w, b, "gelu").square().sum(), [x, w, b])
    want = reference_grads(lambda x, w, b: ACT["gelu"](F.linear(x, w, b)).square().sum(), [x, w, b])
    assert_grads_close(got, want, torch.float32)


def test_zero_size_inner_dim_keeps_the_graph():
    a, b = leaves((4, 0), (0, 3), dtype=torch.float32)
    out = kernels.mm(a, b)
    assert torch.equal(out, torch.zeros(4, 3)) and out.grad_fn is not None
    out.sum().backward()
    assert a.grad.shape == (4, 0) and b.grad.shape == (0, 3)


def test_a_3d_input_with_zero_inner_dim_is_the_bias_as_torch_gives_it():
    x, w, bias = leaves((2, 3, 0), (4, 0), (4,), dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(kernels.linear(x, w, bias), F.linear(x, w, bias))
    out = kernels.linear(x, w, bias)
    out.sum().backward()
    assert out.shape == (2, 3, 4) and x.grad.shape == (2, 3, 0) and w.grad.shape == (4, 0)
    torch.testing.assert_close(bias.grad, torch.full((4,), 6.0))


def test_out_argument_under_autograd_is_refused_as_torch_refuses_it():
    a, b = leaves((4, 8), (8, 3), dtype=torch.float32)
    with pytest.raises(RuntimeError, match="out="):
        kernels.mm(a, b, out=torch.empty(4, 3))


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_backward_products_are_tuned_at_the_first_forward_so_the_backward_tunes_nothing(activation):
    """Under DDP the backward runs beside in-flight all-reduces: its products are met ahead, in the forward."""
    n = 7 if activation is None else 11                     # problems of their own: none met by an earlier test
    x, w, bias = leaves((2, 5, 12), (n, 12), (n,), dtype=torch.float32)
    before = kernels.stats()["tunes"]
    out = kernels.linear(x, w, bias, activation=activation)
    after_forward = kernels.stats()["tunes"]
    # the forward (x·Wᵀ + b as 10xn, k=12; with an activation under autograd: the plain product, act applied after),
    # dX = dY·W (10x12, k=n) and dW = dYᵀ·X (nx12, k=10)
    assert after_forward - before == 3
    (out.double() ** 2).sum().backward()
    assert kernels.stats()["tunes"] == after_forward
    want = reference_grads(lambda a, b, c: (ACT[activation](F.linear(a, b, c)) ** 2).sum(), [x, w, bias])
    assert_grads_close([x.grad, w.grad, bias.grad], want, torch.float32)


def test_only_the_grads_asked_for_are_met_ahead():
    x = torch.randn(6, 9)                                   # an input that needs no grad: no dX product
    (w,) = leaves((5, 9), dtype=torch.float32)
    before = kernels.stats()["tunes"]
    kernels.linear(x, w).sum().backward()
    assert kernels.stats()["tunes"] - before == 2           # the forward and dW only


def test_a_strided_3d_input_meets_its_backward_ahead_too():
    base = leaves((3, 13, 10), dtype=torch.float32)[0]
    x = base.transpose(0, 1)                                # (13, 3, 10): not viewable as 2-D, copied by reshape
    (w,) = leaves((6, 10), dtype=torch.float32, seed=1)
    before = kernels.stats()["tunes"]
    out = kernels.linear(x, w)
    after_forward = kernels.stats()["tunes"]
    out.square().sum().backward()
    assert kernels.stats()["tunes"] == after_forward and after_forward - before == 3
    want = reference_grads(lambda a, b: F.linear(a.transpose(0, 1), b).square().sum(), [base, w])
    assert_grads_close([base.grad, w.grad], want, torch.float32)


@pytest.mark.parametrize("activation", [None, "gelu"])
def test_double_backward_through_kernels_own_autograd(activation):
    """A gradient penalty (create_graph=True, then backward through the grads) with Triton winners: kernels' eager
    Functions differentiate their backward again (they were once_differentiable: it raised where aten won not)."""
    kernels.config.backends = ("triton",)
    x, w, b = leaves((8, 16), (4, 16), (4,), dtype=torch.float32, seed=3)

    def penalty(lin, mm, x, w, b):
        y = lin(x, w, b, activation=activation) if activation else lin(x, w, b)
        (gx,) = torch.autograd.grad((mm(y, w) ** 2).sum(), x, create_graph=True)
        return (gx ** 2).sum()

    got = grads_of(lambda: penalty(kernels.linear, kernels.mm, x, w, b), [x, w, b])
    assert "EagerLinear" in type(kernels.linear(x, w, b).grad_fn).__name__
    torch_linear = (lambda x, w, b, activation=None: ACT[activation](F.linear(x, w, b)))
    want = reference_grads(lambda x, w, b: penalty(torch_linear, torch.mm, x, w, b), [x, w, b])
    assert_grads_close(got, want, torch.float32)
