"""kernels.patch's fused blocks (kernels.dispatch.fused) on CPU through the Triton interpreter: the RMSNorm and
silu(g) * u kernels against eager forward and backward, which modules are recognised, the first-call check that
declines a look-alike computing something else, patch / unpatch round trips, torch.compile tracing the module's own
forward, and a short training run equal to torch's."""
import copy
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from backends import fused_triton
from bench.model_def import GatedMLP, RMSNorm, build_model, model_input
from kernels.core.config import interpret_mode
from kernels.core.errors import InputTypeError
from kernels.dispatch import fused
from kernels.dispatch.fused import eager_rms_norm, rms_norm, silu_mul
from tests.helpers import output_and_grads

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


@pytest.fixture(autouse=True)
def aten_products(monkeypatch):
    """the products through aten (these tests are about the blocks between them)"""
    monkeypatch.setenv("KERNELS_BACKENDS", "aten")
    kernels.config.reset()


def eager_norm(x, weight, eps=1e-6):
    return eager_rms_norm(x, weight, eps)


TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3),
       torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def assert_close(value, reference, dtype, scale=1.0):
    tol = TOL[dtype]
    torch.testing.assert_close(value.float(), reference.float(), rtol=tol["rtol"], atol=tol["atol"] * scale)


# -- the kernels ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_forward_and_backward_match_eager(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 40, dtype=dtype) * 2            # 3-D, a width that is not a power of two
    weight = (1 + 0.1 * torch.randn(40)).to(dtype)
    grad = torch.randn(2, 5, 40, dtype=dtype)
    out, (dx, dw) = output_and_grads(lambda a, b: rms_norm(a, b, 1e-6), (x, weight), grad)
    ref, (rdx, rdw) = output_and_grads(eager_norm, (x, weight), grad)
    assert out.shape == ref.shape and out.dtype is dtype
    assert_close(out, ref, dtype, scale=4)
    assert_close(dx, rdx, dtype, scale=4)
    assert_close(dw, rdw, dtype, scale=16)


def test_rms_norm_of_a_non_contiguous_input():
    torch.manual_seed(0)
    x = torch.randn(24, 9).t()                            # (9, 24), column stride 9
    weight = torch.rand(24) + 0.5
    grad = torch.randn(9, 24)
    out, (dx, dw) = output_and_grads(lambda a, b: rms_norm(a, b, 1e-5), (x, weight), grad)
    ref, (rdx, rdw) = output_and_grads(lambda a, b: eager_norm(a, b, 1e-5), (x, weight), grad)
    assert_close(out, ref, torch.float32)
    assert_close(dx, rdx, torch.float32)
    assert_close(dw, rdw, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_silu_mul_forward_and_backward_match_eager(dtype):
    torch.manual_seed(0)
    g, u = torch.randn(3, 4, 37, dtype=dtype) * 3, torch.randn(3, 4, 37, dtype=dtype)
    grad = torch.randn(3, 4, 37, dtype=dtype)
    out, (dg, du) = output_and_grads(silu_mul, (g, u), grad)
    ref, (rdg, rdu) = output_and_grads(lambda a, b: F.silu(a) * b, (g, u), grad)
    assert_close(out, ref, dtype, scale=4)
    assert_close(dg, rdg, dtype, scale=8)
    assert_close(du, rdu, dtype, scale=4)


# -- modules -------------------------------------------------------------------------------------------------------
class GemmaNorm(nn.Module):
    """Looks like an RMSNorm to the recognition, scales by (1 + weight): the first-call check must decline it."""

    def __init__(self, hidden):
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.zeros(hidden))

    def forward(self, x):
        h = x.float()
        return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)


GemmaNorm.__name__ = "GemmaRMSNorm"


class GeluMLP(nn.Module):
    """A gated MLP by its names, GELU-gated: the check must decline it."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class SwiGLU(nn.Module):
    """torchtitan's names: w1 gate, w3 up, w2 down."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.w1, self.w3 = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def fused_counts():
    snap = kernels.stats()
    return snap["fused_blocks"], {k: v for k, v in snap.items() if k.startswith("fused_declined:")}


def test_a_patched_decoder_stack_fuses_its_blocks_and_matches_eager_forward_and_grads():
    base = build_model(32, 48, 2, 8, "fp32", "cpu")
    x = model_input(6, 32, "fp32", "cpu")
    eager, patched = copy.deepcopy(base), kernels.patch(copy.deepcopy(base))
    blocks, declined = fused_counts()
    results = []
    for model in (eager, patched):
        xi = x.clone().requires_grad_()
        out = model(xi)
        out.square().sum().backward()
        results.append((out, xi.grad, {n: p.grad for n, p in model.named_parameters()}))
    assert fused_counts() == (blocks + 6, declined)          # per layer: two norms and the MLP
    (out_e, dx_e, grads_e), (out_p, dx_p, grads_p) = results
    assert_close(out_p, out_e, torch.float32, scale=10)
    assert_close(dx_p, dx_e, torch.float32, scale=100)
    for name in grads_e:
        assert_close(grads_p[name], grads_e[name], torch.float32, scale=100)
    with torch.no_grad():                                       # warm: no more checks
        patched(x)
    assert fused_counts() == (blocks + 6, declined)


def test_recognised_blocks_by_structure():
    model = nn.ModuleDict({"norm": nn.RMSNorm(16, eps=None), "mlp": SwiGLU(16, 24), "ln": nn.LayerNorm(16),
                           "plain": nn.Sequential(nn.Linear(16, 16), nn.SiLU()),
                           "bad_mlp": nn.ModuleDict({"gate": nn.Linear(16, 24), "up": nn.Linear(16, 20),
                                                     "down": nn.Linear(24, 16)})})
    kernels.patch(model)
    patched = {name for name, m in model.named_modules() if fused.is_fused_forward(m.__dict__.get("forward"))}
    assert patched == {"norm", "mlp"}      # LayerNorm, a Sequential, an MLP whose sizes do not chain: left alone


def test_torch_rms_norm_and_torchtitan_names_fuse_and_agree():
    torch.manual_seed(0)
    model = nn.Sequential(nn.RMSNorm(16, eps=None), SwiGLU(16, 24))
    x = torch.randn(5, 16)
    with torch.no_grad():
        reference = model(x)
        blocks, declined = fused_counts()
        kernels.patch(model)
        out = model(x)
    assert fused_counts() == (blocks + 2, declined)
    assert_close(out, reference, torch.float32, scale=10)


def test_look_alikes_that_compute_something_else_are_declined_by_the_first_call():
    torch.manual_seed(0)
    model = nn.Sequential(GemmaNorm(16), GeluMLP(16, 24))
    with torch.no_grad():
        model[0].weight.normal_()
    x = torch.randn(4, 16)
    with torch.no_grad():
        reference = model(x)
        blocks, declined = fused_counts()
        kernels.patch(model)
        first, second = model(x), model(x)
    blocks_after, declined_after = fused_counts()
    assert blocks_after == blocks
    assert {k: v - declined.get(k, 0) for k, v in declined_after.items()} == {
        "fused_declined:rmsnorm:differs": 1, "fused_declined:gated_mlp:differs": 1}
    assert torch.equal(first, reference) and torch.equal(second, reference)


def test_a_fused_kernel_that_fails_on_the_first_call_leaves_the_module_its_own_forward(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel")

    monkeypatch.setattr(fused_triton, "rmsnorm_forward", broken)
    norm = nn.RMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8, requires_grad=True)
    reference = norm(x)
    kernels.patch(norm)
    out = norm(x)
    out.sum().backward()
    assert torch.equal(out, reference) and x.grad is not None
    assert fused_counts()[1].get("fused_declined:rmsnorm:failed:RuntimeError", 0) >= 1


def test_a_fused_kernel_that_fails_on_a_later_call_hands_that_call_and_the_next_to_the_module(monkeypatch):
    norm = kernels.patch(nn.RMSNorm(8, eps=1e-6))
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm(x)
        state = norm.forward.args[1]
        assert fused.is_fused_forward(norm.__dict__["forward"]) and state.verdict(True, torch.float32, False) == "fused"

        def broken(*args, **kwargs):
            raise RuntimeError("compile failed")

        monkeypatch.setattr(fused_triton, "rmsnorm_forward", broken)
        before = fused_counts()[1].get("fused_declined:rmsnorm:failed:RuntimeError", 0)
        out = norm(x)
        assert state.verdict(True, torch.float32, False) == "declined"
        assert fused_counts()[1]["fused_declined:rmsnorm:failed:RuntimeError"] == before + 1
        torch.testing.assert_close(out, nn.RMSNorm.forward(norm, x), rtol=0, atol=0)


def test_calls_the_kernels_do_not_take_run_the_modules_own_forward():
    norm = kernels.patch(nn.RMSNorm(8, eps=1e-6))
    blocks, declined = fused_counts()
    with torch.no_grad():
        for x in (torch.randn(3, 8, dtype=torch.float64), torch.randn(3, 8).to(torch.bfloat16), torch.zeros(0, 8)):
            out = norm(x)          # fp64; a bf16 input with an fp32 weight (the module's own promotes); empty
            torch.testing.assert_close(out, nn.RMSNorm.forward(norm, x), rtol=0, atol=0)
    assert fused_counts() == (blocks, declined)


def test_torch_func_transforms_get_the_modules_own_forward(monkeypatch):
    """(a wrapped tensor has no storage for a kernel launch on a GPU; the interpreter would read it)"""
    model = build_model(16, 24, 1, 8, "fp32", "cpu")
    x = model_input(4, 16, "fp32", "cpu")
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p):
        return torch.func.functional_call(model, p, (x,)).square().sum()

    reference = torch.func.grad(loss)(params)
    kernels.patch(model)
    with torch.no_grad():
        model(x)                      # the blocks checked and fused for plain calls
    fused_calls = []
    monkeypatch.setattr(fused, "_fused", lambda *a: fused_calls.append(a) or pytest.fail("fused under torch.func"))
    patched = torch.func.grad(loss)(params)
    assert fused_calls == []
    for name in reference:
        torch.testing.assert_close(patched[name], reference[name], rtol=1e-4, atol=1e-4)


def test_patch_arguments_round_trip_and_copies():
    model = build_model(16, 24, 1, 8, "fp32", "cpu")
    with pytest.raises(InputTypeError, match="fuse"):
        kernels.patch(model, fuse="yes")
    kernels.patch(model, fuse=False)
    assert not any(fused.is_fused_forward(m.__dict__.get("forward")) for m in model.modules())
    kernels.unpatch(model)
    kernels.patch(kernels.patch(model))
    fused_forwards = [m for m in model.modules() if fused.is_fused_forward(m.__dict__.get("forward"))]
    assert len(fused_forwards) == 3
    x = model_input(4, 16, "fp32", "cpu")
    with torch.no_grad():
        out = model(x)
        copied = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(copied(x), out) and torch.equal(loaded(x), out)
    kernels.patch(model, fuse=False)            # the blocks unfused again, the linear layers still routed
    assert not any(fused.is_fused_forward(m.__dict__.get("forward")) for m in model.modules())
    assert sum("forward" in m.__dict__ for m in model.modules()) == 5
    kernels.unpatch(model)
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_torch_compile_traces_the_modules_own_forward_in_one_graph():
    model = kernels.patch(build_model(16, 24, 1, 8, "fp32", "cpu"))
    x = model_input(4, 16, "fp32", "cpu")
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_training_with_fused_blocks_follows_torchs_loss_curve():
    base = build_model(16, 24, 1, 8, "fp32", "cpu")
    x = model_input(6, 16, "fp32", "cpu", seed=3)
    target = torch.randn_like(x)
    curves = []
    for model in (copy.deepcopy(base), kernels.patch(copy.deepcopy(base))):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        losses = []
        for _ in range(8):
            opt.zero_grad()
            loss = F.mse_loss(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves.append(losses)
    assert curves[0][-1] < curves[0][0]
    torch.testing.assert_close(torch.tensor(curves[1]), torch.tensor(curves[0]), rtol=1e-4, atol=1e-5)


# -- what a review found (thirty-fifth session) ---------------------------------------------------------------------
def test_torch_rms_norm_default_eps_is_float32s_for_half_inputs_at_any_scale():
    norm = nn.RMSNorm(64, eps=None).to(torch.bfloat16)
    x = torch.randn(6, 64).to(torch.bfloat16)
    kernels.patch(norm)
    with torch.no_grad():
        norm(x)                                                  # checked on unit-scale rows
        for scale in (1.0, 0.1, 0.02):
            small = (torch.randn(6, 64) * scale).to(torch.bfloat16)
            torch.testing.assert_close(norm(small).float(), nn.RMSNorm.forward(norm, small).float(), rtol=2e-2,
                                       atol=2e-2)


class DropoutMLP(nn.Module):
    def __init__(self, hidden, inner, dropout_child: bool):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(hidden, inner), nn.Linear(hidden, inner), nn.Linear(inner, hidden)
        self.drop = nn.Dropout(0.5) if dropout_child else None
        self.p = 0.5

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)
        h = self.drop(h) if self.drop is not None else F.dropout(h, self.p, self.training)
        return self.down(h)


class GainMLP(SwiGLU):
    def __init__(self, hidden, inner):
        super().__init__(hidden, inner)
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return super().forward(x) * self.gain


class BufferNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.eps, self.weight = 1e-6, nn.Parameter(torch.ones(hidden))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x):
        return eager_norm(x, self.weight, self.eps) * self.scale


BufferNorm.__name__ = "ScaledRMSNorm"


def test_blocks_with_state_beyond_their_projections_or_weight_are_not_patched():
    model = nn.ModuleDict({"dropout_child": DropoutMLP(8, 12, True), "gain": GainMLP(8, 12),
                           "buffer_norm": BufferNorm(8), "plain": DropoutMLP(8, 12, False)})
    kernels.patch(model)
    patched = {name for name, m in model.named_modules() if fused.is_fused_forward(m.__dict__.get("forward"))}
    assert patched == {"plain"}


def test_a_verdict_holds_for_its_training_mode_only():
    """A block checked in eval mode and fused there is checked again in training mode, where its forward (dropout)
    computes something else and is declined."""
    torch.manual_seed(0)
    mlp = kernels.patch(DropoutMLP(8, 12, False)).eval()
    x = torch.randn(64, 8)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), DropoutMLP.forward(mlp, x), rtol=1e-5, atol=1e-5)
        state = mlp.forward.args[1]
        assert state.verdict(False, torch.float32, False) == "fused"
        mlp.train()
        dropped = mlp(torch.ones(64, 8))
    assert state.verdict(True, torch.float32, False) == "declined"
    with torch.no_grad():
        eval_out = mlp.eval()(torch.ones(64, 8))
    assert not torch.equal(dropped, eval_out)                   # dropout applied in training


def test_one_outlier_does_not_let_a_look_alike_pass_the_check():
    torch.manual_seed(0)
    norm = GemmaNorm(64).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight[3] = 100.0
    mlp = GeluMLP(16, 24).to(torch.bfloat16)
    x = torch.randn(6, 64).to(torch.bfloat16)
    xm = torch.randn(6, 16)
    xm[2] *= 30
    kernels.patch(norm)
    kernels.patch(mlp)
    with torch.no_grad():
        norm(x)
        mlp(xm.to(torch.bfloat16))
    assert norm.forward.args[1].verdict(True, torch.bfloat16, False) == "declined"
    assert mlp.forward.args[1].verdict(True, torch.bfloat16, False) == "declined"


def test_the_check_reads_every_block_of_rows(monkeypatch):
    monkeypatch.setattr(fused, "CHECK_CHUNK", 8)                # 2 rows of 4 a block
    own = torch.randn(7, 4)
    assert fused._agrees(own.clone(), own)
    for row in (0, 3, 6):
        off = own.clone()
        off[row, 1] += 1.0
        assert not fused._agrees(off, own)
    nan_late = own.clone()
    nan_late[6, 0] = float("nan")
    assert not fused._agrees(nan_late, own)


def test_the_check_compares_non_finite_values_in_place():
    inf = float("inf")
    assert not fused._agrees(torch.tensor([11.0, -5.0, inf]), torch.tensor([1.0, 2.0, inf]))
    assert not fused._agrees(torch.tensor([1.0, 2.0, inf]), torch.tensor([1.0, 2.0, -inf]))
    assert fused._agrees(torch.tensor([1.0, 2.0, inf, float("nan")]), torch.tensor([1.0, 2.0, inf, float("nan")]))


def test_a_double_backward_through_fused_blocks_matches_eager():
    """A gradient penalty: the grads of a grad norm (a norm and an MLP: CPU attention has no double backward)."""
    torch.manual_seed(0)
    base = nn.Sequential(RMSNorm(16), GatedMLP(16, 24))
    x = torch.randn(4, 16)
    results = []
    for model in (copy.deepcopy(base), kernels.patch(copy.deepcopy(base))):
        with torch.no_grad():
            model(x)
        xi = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(xi).square().sum(), xi, create_graph=True)
        gx.square().sum().backward()
        results.append({n: p.grad for n, p in model.named_parameters()})
    for name in results[0]:
        torch.testing.assert_close(results[1][name], results[0][name], rtol=1e-4, atol=1e-4)


def test_keyword_inputs_strided_weights_and_jit_trace_run_the_modules_own_forward():
    torch.manual_seed(0)
    norm = kernels.patch(nn.RMSNorm(8, eps=1e-6))
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(norm(x=x), nn.RMSNorm.forward(norm, x))
        strided = kernels.patch(nn.RMSNorm(8, eps=1e-6))
        strided.weight = nn.Parameter(torch.randn(16)[::2])
        assert strided.weight.stride(0) == 2
        torch.testing.assert_close(strided(x), nn.RMSNorm.forward(strided, x), rtol=0, atol=0)
        traced = torch.jit.trace(norm, x)
    torch.testing.assert_close(traced(x), nn.RMSNorm.forward(norm, x), rtol=1e-6, atol=1e-6)


def test_a_call_the_module_itself_refuses_leaves_no_verdict():
    mlp = kernels.patch(SwiGLU(8, 12))
    with pytest.raises(RuntimeError):
        mlp(torch.randn(3, 9))                     # wrong width: the module's own error, nothing decided
    assert mlp.forward.args[1].verdicts == {}
    x = torch.randn(3, 8, requires_grad=True)
    mlp(x).sum().backward()
    assert mlp.forward.args[1].verdict(True, torch.float32, False) == "fused" and x.grad is not None


@pytest.mark.parametrize("warm", [False, True])
def test_non_reentrant_checkpointing_over_fused_and_declined_blocks(warm):
    """Recomputation must save what the first forward saved, and its early stop (an exception raised through the
    block) is checkpoint's, not a failure of the fused path."""
    torch.manual_seed(0)
    base = nn.Sequential(RMSNorm(16), GatedMLP(16, 24), GemmaNorm(16), GeluMLP(16, 24))
    with torch.no_grad():
        base[2].weight.normal_()
    x = torch.randn(5, 16)
    grads = []
    for model in (copy.deepcopy(base), kernels.patch(copy.deepcopy(base))):
        if warm:
            with torch.no_grad():
                model(x)
        xi = x.clone().requires_grad_()
        out = torch.utils.checkpoint.checkpoint(model, xi, use_reentrant=False)
        out.square().sum().backward()
        grads.append([xi.grad] + [p.grad for p in model.parameters()])
    for patched, own in zip(grads[1], grads[0]):
        torch.testing.assert_close(patched, own, rtol=1e-4, atol=1e-5)


def test_a_gated_mlp_whose_first_batch_cannot_tell_activations_apart_is_still_declined():
    """A first batch of zeros: SiLU and GELU both give 0; the probe of the library's own tells them apart."""
    mlp = kernels.patch(GeluMLP(16, 24))
    with torch.no_grad():
        mlp(torch.zeros(4, 16))
    assert mlp.forward.args[1].verdict(True, torch.float32, False) == "declined"


class ActMLP(nn.Module):
    """HF llama's form: the activation a child module (act_fn) beside the projections."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def test_an_activation_replaced_after_the_verdict_is_checked_again():
    torch.manual_seed(0)
    mlp = kernels.patch(ActMLP(16, 24))
    x = torch.randn(4, 16)
    with torch.no_grad():
        mlp(x)
        assert mlp.forward.args[1].verdict(True, torch.float32, False) == "fused"
        mlp.act_fn = nn.GELU(approximate="tanh")
        out = mlp(x)
    assert mlp.forward.args[1].verdict(True, torch.float32, False) == "declined"
    torch.testing.assert_close(out, ActMLP.forward(mlp, x), rtol=0, atol=0)


def test_contiguous_inputs_whose_size_1_dims_have_odd_strides_are_normed_row_by_row():
    """A contiguous (B, 1, H) may have any stride on its size-1 dim (a seq-first model's decode step: a transpose of
    (1, B, H)); rows are B evenly spaced ones all the same, and a fused verdict reached on a plain input holds."""
    torch.manual_seed(0)
    norm = kernels.patch(nn.RMSNorm(16, eps=1e-6))
    with torch.no_grad():
        norm(torch.randn(4, 16))
        odd = torch.randn(1, 5, 16).transpose(0, 1)
        assert odd.is_contiguous() and odd.stride(1) == 80
        torch.testing.assert_close(norm(odd), nn.RMSNorm.forward(norm, odd), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="unit column stride"):
            fused_triton.rmsnorm_forward(torch.randn(3, 4, 16).transpose(0, 1), norm.weight, 1e-6)


class FnMLP(nn.Module):
    """An activation held as a plain attribute (a function), not a child module."""

    def __init__(self, hidden, inner):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner, bias=False), nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.act = F.silu

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def test_an_activation_attribute_or_a_childs_forward_replaced_after_the_verdict_is_checked_again():
    torch.manual_seed(0)
    x = torch.randn(4, 16)
    fn_mlp, act_mlp = kernels.patch(FnMLP(16, 24)), kernels.patch(ActMLP(16, 24))
    with torch.no_grad():
        fn_mlp(x), act_mlp(x)
        fn_mlp.act = lambda t: F.gelu(t, approximate="tanh")
        act_mlp.act_fn.forward = lambda t: F.gelu(t, approximate="tanh")
        for mlp in (fn_mlp, act_mlp):
            out = mlp(x)
            assert mlp.forward.args[1].verdict(True, torch.float32, False) == "declined"
            torch.testing.assert_close(out, type(mlp).forward(mlp, x), rtol=0, atol=0)


def test_a_replaced_projection_is_not_kept_alive_by_the_patch():
    mlp = kernels.patch(ActMLP(16, 24))
    with torch.no_grad():
        mlp(torch.randn(4, 16))
        old = weakref.ref(mlp.gate_proj)
        mlp.gate_proj = nn.Sequential(nn.Linear(16, 24, bias=False))   # not servable: its own forward runs
        mlp(torch.randn(4, 16))
    gc.collect()
    assert old() is None


def test_inference_tensors_with_grad_take_the_fused_path():
    """A tensor made under torch.inference_mode, used later where the weights train: autograd cannot save it, so the
    fused Functions save a copy (eager's norm saves its own temporaries and works; eager's nn.Linear refuses it)."""
    torch.manual_seed(0)
    norm = kernels.patch(nn.RMSNorm(16, eps=1e-6))
    with torch.inference_mode():
        x, g = torch.randn(4, 16), torch.randn(4, 16)
    for _ in range(2):                            # the first call's check, then a warm call
        out = norm(x)
        out.sum().backward()
        torch.testing.assert_close(out, nn.RMSNorm.forward(norm, x), rtol=1e-5, atol=1e-5)
    assert norm.forward.args[1].verdict(True, torch.float32, False) == "fused"
    u = torch.randn(4, 16, requires_grad=True)
    silu_mul(g, u).sum().backward()
    torch.testing.assert_close(u.grad, F.silu(g), rtol=1e-5, atol=1e-5)


def test_trained_biases_of_frozen_projections_count_as_grad():
    mlp = ActMLP(16, 24)
    mlp.gate_proj = nn.Linear(16, 24, bias=True)
    state = fused.fusable(mlp)
    for p in mlp.parameters():
        p.requires_grad_(False)
    assert not fused._projections_train(mlp, state)
    mlp.gate_proj.bias.requires_grad_(True)
    assert fused._projections_train(mlp, state)
