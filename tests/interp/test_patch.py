"""kernels.patch / kernels.unpatch on whole models, and `with kernels.enabled():` over torch's matrix products, on
CPU through the tuner (TRITON_INTERPRET=1): routed calls reach kernels (stats() moves), what kernels does not serve
passes through to torch unchanged and is counted with its reason."""
import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.core.config import interpret_mode

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


@pytest.fixture(autouse=True)
def small_space(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,triton")
    kernels.config.reset()
    kernels.config.benchmark_space = 1


def mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4)).to(dtype)


def served_and_passed(fn):
    """(calls that reached kernels: tunes + memory hits, pass-throughs by reason) while fn ran."""
    before = kernels.stats()
    result = fn()
    after = kernels.stats()
    reached = (after["tunes"] + after["memory_hits"]) - (before["tunes"] + before["memory_hits"])
    passed = {k.removeprefix("passthrough:"): v - before.get(k, 0) for k, v in after.items()
              if k.startswith("passthrough:") and v != before.get(k, 0)}
    assert after["passthroughs"] - before["passthroughs"] == sum(passed.values())      # the total and its reasons
    return result, reached, passed


# -- patch / unpatch -------------------------------------------------------------------------------------------
def test_patch_routes_every_linear_and_unpatch_restores_the_exact_forward():
    model, x = mlp(), torch.randn(5, 12)
    with torch.no_grad():
        before = model(x)
        assert kernels.patch(model) is model
        patched, reached, passed = served_and_passed(lambda: model(x))
        assert reached == 3 and passed == {}
        torch.testing.assert_close(patched, before, rtol=1e-4, atol=1e-4)
        assert kernels.unpatch(model) is model
        assert all("forward" not in m.__dict__ for m in model.modules())
        restored, reached, _ = served_and_passed(lambda: model(x))
    assert torch.equal(restored, before) and reached == 0


def test_patch_is_idempotent_and_survives_deepcopy_and_pickling():
    model = kernels.patch(kernels.patch(mlp()))
    forwards = [m.__dict__.get("forward") for m in model.modules()]
    kernels.patch(model)
    assert [m.__dict__.get("forward") for m in model.modules()] == forwards
    x = torch.randn(3, 12)
    for clone in (copy.deepcopy(model), _pickled(model)):
        linears = [m for m in clone.modules() if isinstance(m, nn.Linear)]
        assert all(m.forward.args[0] is m for m in linears)           # bound to the copy, not the original
        with torch.no_grad():
            _, reached, _ = served_and_passed(lambda: clone(x))
        assert reached == 3
    kernels.unpatch(model)
    kernels.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def _pickled(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_patch_leaves_subclasses_with_their_own_forward_and_foreign_overrides_alone():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Scaled(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))
    foreign = lambda x: x          # noqa: E731  (someone else's instance-level forward)
    model[2].forward = foreign
    kernels.patch(model)
    assert "forward" not in model[0].__dict__ and "forward" in model[1].__dict__ and model[2].forward is foreign
    kernels.unpatch(model)
    assert "forward" not in model[1].__dict__ and model[2].forward is foreign


def test_training_20_steps_with_patch_follows_torch():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 12, generator=generator)
    y = torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(32, 4, generator=generator)     # a target the MLP can learn

    def losses(patched: bool) -> list[float]:
        model = mlp(seed=3)
        if patched:
            kernels.patch(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        curve = []
        for _ in range(20):
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        return curve

    kernels.config.backends = ("triton",)             # every product, forward and backward, a Triton kernel's
    tunes = kernels.stats()["tunes"]
    with_kernels = losses(True)
    # forward: 3 layers (bias epilogue); backward: dW of each, dX of the two upper ones
    assert kernels.stats()["tunes"] - tunes == 8
    with_torch = losses(False)
    assert with_kernels[-1] < with_kernels[0]         # it trains
    torch.testing.assert_close(with_kernels, with_torch, rtol=1e-4, atol=1e-5)


def test_patched_model_with_an_fp64_linear_still_runs_and_counts_the_pass_through():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4).double())
    kernels.patch(model)
    x = torch.randn(3, 8)
    with torch.no_grad():
        h, reached, passed = served_and_passed(lambda: model[1](model[0](x)))
        assert reached == 1 and passed == {}
        out, reached, passed = served_and_passed(lambda: model[2](h.double()))
        assert reached == 0 and passed == {"dtype=float64": 1}
    torch.testing.assert_close(out, F.linear(h.double(), model[2].weight, model[2].bias), rtol=0, atol=0)


@pytest.mark.parametrize("model", [None, "a model", nn.Linear])
def test_patch_and_unpatch_name_a_wrong_argument(model):
    for fn in (kernels.patch, kernels.unpatch):
        with pytest.raises(TypeError, match=f"kernels.{fn.__name__}: model must be a torch.nn.Module"):
            fn(model)


# -- enabled() -------------------------------------------------------------------------------------------------
def _routed_cases():
    torch.manual_seed(0)
    a, b, bias = torch.randn(6, 16), torch.randn(16, 5), torch.randn(5)
    a3 = torch.randn(2, 3, 16)
    return {
        "torch.mm": (lambda: torch.mm(a, b), a.double() @ b.double()),
        "Tensor.mm": (lambda: a.mm(b), a.double() @ b.double()),
        "@": (lambda: a @ b, a.double() @ b.double()),
        "torch.matmul 3-D @ 2-D": (lambda: torch.matmul(a3, b), a3.double() @ b.double()),
        "Tensor.matmul": (lambda: a.matmul(b.t().contiguous().t()), a.double() @ b.double()),
        "F.linear": (lambda: F.linear(a, b.t(), bias), a.double() @ b.double() + bias.double()),
        "torch.addmm": (lambda: torch.addmm(bias, a, b), a.double() @ b.double() + bias.double()),
        "Tensor.addmm": (lambda: bias.addmm(a, b), a.double() @ b.double() + bias.double()),
    }


@pytest.mark.parametrize("case", list(_routed_cases()))
def test_enabled_routes_each_function_through_kernels(case):
    call, want = _routed_cases()[case]
    with kernels.enabled():
        got, reached, passed = served_and_passed(call)
    assert reached == 1 and passed == {}
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    _, reached, _ = served_and_passed(call)                   # outside the block: torch's again
    assert reached == 0


def _passed_cases():
    torch.manual_seed(0)
    a, b, bias = torch.randn(6, 16), torch.randn(16, 5), torch.randn(5)
    a64, b64, a8, b8 = a.double(), b.double(), a.to(torch.int8), b.to(torch.int8)
    ac, bc, sparse = a.to(torch.complex64), b.to(torch.complex64), a.to_sparse()
    a3, b3, full_input, bias_row = torch.randn(2, 6, 16), torch.randn(2, 16, 5), torch.randn(6, 5), torch.randn(1, 5)
    return {
        "dtype=float64": lambda: torch.mm(a64, b64),
        "dtype=int8": lambda: torch.mm(a8, b8),
        "dtype=complex64": lambda: ac @ bc,
        "layout=sparse_coo": lambda: torch.mm(sparse, b),
        "dims=1-D@2-D": lambda: a[0] @ b,
        "dims=3-D@3-D": lambda: a3 @ b3,
        "addmm-scale": lambda: torch.addmm(bias, a, b, beta=0.5),
        "addmm-input": lambda: torch.addmm(full_input, a, b),
        "out": lambda: torch.mm(a, b, out=torch.empty(6, 5)),
        "bias": lambda: F.linear(a, b.t(), bias_row),
        "batched=bmm": lambda: torch.bmm(a3, b3),
        "batched=baddbmm": lambda: b3.new_zeros(2, 6, 5).baddbmm(a3, b3),
    }


@pytest.mark.parametrize("reason", list(_passed_cases()))
def test_enabled_passes_through_what_kernels_does_not_serve_with_the_reason(reason):
    call = _passed_cases()[reason]
    want = call()
    with kernels.enabled():
        got, reached, passed = served_and_passed(call)
    assert passed == {reason: 1} and reached == 0
    torch.testing.assert_close(got.to_dense() if got.layout != torch.strided else got, want)


@pytest.mark.parametrize("reason,a,b", [("shape", torch.randn(3, 4), torch.randn(5, 6)),
                                         ("dtypes-differ", torch.randn(3, 4), torch.randn(4, 6).half())])
def test_enabled_lets_torch_raise_its_own_error(reason, a, b):
    def error() -> str:
        with pytest.raises(RuntimeError) as raised:
            torch.mm(a, b)
        return str(raised.value)

    with kernels.enabled():
        passed_through, reached, passed = served_and_passed(error)
    assert passed_through == error() and passed == {reason: 1} and reached == 0


def test_enabled_is_also_a_decorator():
    a, b = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)

    @kernels.enabled()
    def product(x, y):
        return torch.mm(x, y)

    got, reached, passed = served_and_passed(lambda: product(a, b))
    assert passed == {"dtype=float64": 1} and reached == 0      # routed (then passed through, fp64)
    torch.testing.assert_close(got, a @ b)
    assert served_and_passed(lambda: torch.mm(a, b))[2] == {}     # outside the function: not routed


def test_kernels_calls_inside_enabled_tune_without_routing_their_own_torch_calls():
    """A cold kernels call inside the block (a patched model, a backward) tunes as usual: the torch calls of the
    tune itself (aten candidates, the float64 reference) are not routed back into kernels nor counted."""
    model = kernels.patch(mlp())
    x = torch.randn(4, 12)
    with kernels.enabled(), kernels.enabled():
        before = kernels.stats()
        loss = model(x).square().sum()
        loss.backward()
        after = kernels.stats()
    assert after["tunes"] - before["tunes"] >= 3 and after["passthroughs"] == before["passthroughs"]
    assert all(p.grad is not None for p in model.parameters())


def test_enabled_takes_no_arguments_and_nests():
    with pytest.raises(TypeError):
        kernels.enabled("mm")
    a, b = torch.randn(4, 8), torch.randn(8, 4)
    with kernels.enabled():
        with kernels.enabled():
            inner, reached_inner, _ = served_and_passed(lambda: a @ b)
        outer, reached_outer, _ = served_and_passed(lambda: a @ b)
    assert reached_inner == 1 and reached_outer == 1 and torch.equal(inner, outer)
    mode = kernels.enabled()                      # one instance entered twice, nested
    with mode:
        with mode:
            pass
        _, reached, _ = served_and_passed(lambda: a @ b)
        assert reached == 1
    _, reached, _ = served_and_passed(lambda: a @ b)
    assert reached == 0                           # and gone after the outer block
