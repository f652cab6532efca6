"""Fused blocks for `kernels.patch`: the memory-bound code between a llama-style model's GEMMs, in one kernel each.

Eager PyTorch runs an RMSNorm as about eight kernels over the activations (fp32 casts, square, mean, rsqrt, two
products) and a SiLU-gated MLP's `silu(gate(x)) * up(x)` as two, each reading and writing the whole (M, intermediate)
tensor; their backwards read and write it again several times. In a training step of a llama-7B layer at M = 4096
that traffic is a tenth of the step (torch.compile's 1.12x over eager comes from fusing it). Here:
- an RMSNorm module computes through one Triton kernel (forward) and one (backward: dx, and dweight from per-program
  partial sums), and
- a gated MLP's `silu(g) * u` through one kernel each way, its three projections still through kernels.linear.

Which modules: recognised by structure, then checked on their first call. An RMSNorm is a module whose class name
says RMSNorm, with no children or buffers, one parameter `weight` (1-D) and its epsilon in `eps` or `variance_epsilon`
(llama, Mistral, Qwen, torch.nn.RMSNorm); a gated MLP has nn.Linear children named gate/up/down,
gate_proj/up_proj/down_proj or w1/w3/w2 whose sizes chain, and no other state (no parameter, buffer or dropout of its
own). Nothing about the module's forward is assumed: the first call in each training mode and dtype runs the module's
own forward beside the fused path, on the call's input and on a probe of the library's own, and the fused path serves
that mode and dtype only if they agree within the dtype's rounding (a Gemma-style `(1 + weight)` norm or a GELU-gated
MLP disagrees and keeps its own forward, counted in kernels.stats() as `fused_declined:<block>:differs`). Calls the
fused kernels do not take (other dtypes, a CPU tensor without the Triton interpreter, keyword or extra arguments, a
weight on another device or strided, torch.func's transforms, torch.jit.trace, fewer than FUSE_MIN_ELEMENTS on a GPU,
where the step is host-bound) run the module's own forward. A double backward runs through torch's ops.

Under torch.compile the module's own forward is what gets traced: Inductor fuses this code itself, and better, with
the neighbours (residual adds) that a module boundary hides from us. A call captured in a CUDA graph before the
module's first check runs its own forward (the check needs results on the host).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from backends import fused_triton
from kernels.core import counters
from kernels.core.config import interpret_mode
from kernels.dispatch.api import functorch_wrapped

# errors that are not the fused path's to handle: out of memory (the module's own forward would not fare better), and
# non-reentrant activation checkpointing's early stop of a recomputation (raised from its saved-tensor hook)
_PROPAGATED = (torch.OutOfMemoryError,) + tuple(
    e for e in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if isinstance(e, type))
# a gated MLP's projections, by the names llama-family code gives them: (gate, up, down)
MLP_NAMES = (("gate", "up", "down"), ("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
EPS_NAMES = ("eps", "variance_epsilon")
SERVED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the first call's check: the fused result within this many of the dtype's units of rounding (relative to the largest
# reference value, so that values near zero do not decide) of the module's own. Both sides round the same steps; they
# differ where an exp or rsqrt rounds differently (1 unit, seen on CPU), and a different computation (a (1 + weight)
# norm, another activation) differs by far more than this.
CHECK_UNITS = 4
CHECK_CHUNK = 1 << 22          # elements of the outputs compared at a time (a first call's extra memory stays bounded)
# a CUDA call with grad on fewer elements of x (rows x hidden) runs the module's own forward: there the step is bound by
# the host, and a fused block's autograd Function (forward and backward in Python) costs more host time than eager's
# several small kernels do. H200, llama layer forward + backward (hidden 4096, 3 rounds; thirty-sixth session, compiled
# launches, no floor): fused 0.93 / 1.01 / 1.10x eager at M = 256 / 1024 / 2048 where the linear layers alone ran
# 1.04 / 1.00 / 1.00x. 2^22 is M = 1024 at hidden 4096.
FUSE_MIN_ELEMENTS = 1 << 22
# the same for a call without grad (inference): its warm path is a compiled launch and no autograd node. H200, llama
# layer forward (4 rounds; thirty-sixth session): fused 1.15 / 1.41 / 1.02 / 1.15 / 1.47 / 1.15x eager at M = 1 / 16 /
# 128 / 256 / 512 / 1024 where the linear layers alone ran 0.85-1.00x; a patched RMSNorm's host time 38-42 us per
# call against eager's 96-103 (M = 16, 128).
FUSE_MIN_ELEMENTS_NO_GRAD = 1


@dataclass
class BlockState:
    """One patched module's fused state: a verdict per (training mode, dtype, on a GPU) met, 'fused' or 'declined',
    each from the first call in that mode and dtype on that kind of device (a forward may use self.training: dropout;
    or round by dtype)."""
    block: str                     # "rmsnorm" | "gated_mlp"
    names: tuple[str, str, str] | None = None      # a gated MLP's (gate, up, down) attribute names
    verdicts: dict = field(default_factory=dict)   # (training, dtype, is_cuda) -> "fused" | "declined"
    children: tuple = ()           # a gated MLP's _snapshot when its verdicts were reached (a change: checked again)

    def verdict(self, training: bool, dtype: torch.dtype, is_cuda: bool) -> str:
        return self.verdicts.get((training, dtype, is_cuda), "unchecked")


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, eps):
        y, rstd = fused_triton.rmsnorm_forward(x2, weight, eps)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, weight, rstd = ctx.saved_tensors
        if torch.is_grad_enabled():         # create_graph: a backward autograd can differentiate again
            return (*_differentiable_grads(lambda a, w: eager_rms_norm(a, w, ctx.eps), (x2, weight), dy,
                                           ctx.needs_input_grad[:2]), None)
        dx, dweight = fused_triton.rmsnorm_backward(dy.contiguous(), x2, weight, rstd)
        return dx, (dweight if ctx.needs_input_grad[1] else None), None


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        ctx.save_for_backward(g, u)
        return fused_triton.swiglu_forward(g, u)

    @staticmethod
    def backward(ctx, dh):
        g, u = ctx.saved_tensors
        if torch.is_grad_enabled():
            return _differentiable_grads(lambda a, b: F.silu(a) * b, (g, u), dh, ctx.needs_input_grad)
        return fused_triton.swiglu_backward(dh.contiguous(), g, u)


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The computation the RMSNorm kernels fuse, in torch ops (llama's rounding)."""
    h = x.float()
    return (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _differentiable_grads(forward, inputs, grad, needed) -> tuple:
    """The grads of forward(*inputs) through torch's own ops, themselves differentiable (a double backward: gradient
    penalties, Hessian-vector products)."""
    wanted = [t for t, need in zip(inputs, needed) if need]
    with torch.enable_grad():
        found = iter(torch.autograd.grad(forward(*inputs), wanted, grad, create_graph=True))
    return tuple(next(found) if need else None for need in needed)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """llama's RMSNorm of x (..., N) with weight (N,), through the fused kernels (differentiable)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(_rows(_savable(x)), weight, eps).view(x.shape)
    if x.is_contiguous():                   # no autograd node, no view: a warm call's host time is the step's
        return fused_triton.rmsnorm_forward(x, weight, eps, keep_rstd=False)[0]
    return fused_triton.rmsnorm_forward(_rows(x), weight, eps, keep_rstd=False)[0].view(x.shape)


def _savable(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy when it is an inference tensor (made under torch.inference_mode), which autograd refuses to save
    for a backward; eager's ops save their own temporaries instead and never meet that."""
    return t.clone() if t.is_inference() and not torch.is_inference_mode_enabled() else t


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., N) as rows (M, N) with a unit column stride: a view where the strides allow, else a copy."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for g, u of one shape, through the fused kernels (differentiable)."""
    if g.shape != u.shape:
        raise ValueError(f"silu_mul: g and u must have one shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    if torch.is_grad_enabled() and (g.requires_grad or u.requires_grad):
        return _SwiGLUFn.apply(_savable(g).contiguous(), _savable(u).contiguous())
    return fused_triton.swiglu_forward(g.contiguous(), u.contiguous())


# -- recognition ---------------------------------------------------------------------------------------------------
def _eps_of(module: nn.Module):
    for name in EPS_NAMES:
        value = getattr(module, name, False)
        if value is None or (isinstance(value, float) and value >= 0):
            return name
    return None


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _is_rmsnorm(module: nn.Module) -> bool:
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return ("rmsnorm" in type(module).__name__.lower() and not any(True for _ in module.children())
            and set(params) == {"weight"} and not any(True for _ in module.buffers(recurse=False))
            and weight.dim() == 1 and _eps_of(module) is not None
            and len(getattr(module, "normalized_shape", (1,))) == 1)


def _mlp_names(module: nn.Module) -> tuple[str, str, str] | None:
    """The (gate, up, down) names of a gated MLP: the three nn.Linear children and nothing else with state (no
    parameter, buffer or dropout of the MLP's own; an activation module may sit beside them)."""
    if _has_state(module):
        return None
    children = dict(module.named_children())
    for names in MLP_NAMES:
        gate, up, down = (children.get(n) for n in names)
        if not (all(isinstance(m, nn.Linear) for m in (gate, up, down))
                and gate.weight.shape == up.weight.shape and down.weight.shape[1] == gate.weight.shape[0]):
            continue
        others = [m for n, m in children.items() if n not in names]
        if all(not isinstance(m, nn.modules.dropout._DropoutNd) and not any(True for _ in m.parameters())
               and not any(True for _ in m.buffers()) for m in others):
            return names
    return None


def fusable(module: nn.Module) -> BlockState | None:
    """The fused state to patch `module` with, or None when it is not a block this module fuses."""
    if "forward" in module.__dict__:        # someone's own override (or ours): left alone
        return None
    if _is_rmsnorm(module):
        return BlockState("rmsnorm")
    names = _mlp_names(module)
    return None if names is None else BlockState("gated_mlp", names=names)


def is_fused_forward(forward) -> bool:
    return isinstance(forward, functools.partial) and forward.func is _fused_forward


def patch_blocks(model: nn.Module) -> None:
    for module in model.modules():
        state = fusable(module)
        if state is not None:
            module.forward = functools.partial(_fused_forward, module, state)


# -- calls ---------------------------------------------------------------------------------------------------------
def _tracing() -> bool:
    return torch.compiler.is_compiling() or torch.jit.is_tracing()


def _runs_here(t: torch.Tensor) -> bool:
    """The fused kernels run on this tensor's device: a GPU, or CPU through the Triton interpreter."""
    return interpret_mode() == (t.device.type == "cpu") and t.device.type in ("cuda", "cpu")


def _weight(module, state):
    """The weight the kernels take beside x (the norm's; the gate projection's for an MLP), or None when the module
    is no longer the block it was patched as (a parameter removed, a projection replaced by something else)."""
    if state.block == "rmsnorm":
        return module._parameters.get("weight")
    children = module._modules
    gate, up, down = (children.get(n) for n in state.names)
    if isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and isinstance(down, nn.Linear):
        return gate._parameters.get("weight")
    return None


def _projections_train(module, state) -> bool:
    """Whether the gate or up projection has a parameter that requires grad (silu(g) * u then takes the autograd
    path): frozen weights with trained biases count."""
    return any(p is not None and p.requires_grad for n in state.names[:2]
               for p in (module._modules[n].weight, module._modules[n].bias))


def _servable(module, state, x) -> bool:
    """Whether this call can take the fused path, checked on every call (the module's own forward otherwise): on a
    warm call this is most of the fused path's host time, which is the step's at small M."""
    if not (type(x) is torch.Tensor and x.dtype in SERVED_DTYPES and x.layout is torch.strided and x.dim() >= 1):
        return False
    weight = _weight(module, state)
    if weight is None or weight.dtype is not x.dtype or weight.device != x.device:
        return False
    if x.is_cuda:
        grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (
            state.block == "gated_mlp" and _projections_train(module, state)))
        if x.numel() < (FUSE_MIN_ELEMENTS if grad else FUSE_MIN_ELEMENTS_NO_GRAD):
            return False
    elif not x.numel():
        return False
    width = x.shape[-1]
    if state.block == "rmsnorm":
        fits = weight.dim() == 1 and width == weight.shape[0] <= fused_triton.MAX_ROW and weight.stride(0) == 1
    else:
        fits = width == weight.shape[1]
    # torch.func's transforms wrap tensors: the Functions here have no batching rule
    return fits and not functorch_wrapped(x) and not functorch_wrapped(weight)


def _eps(module) -> float:
    """The module's epsilon; None (torch.nn.RMSNorm's default) is float32's machine epsilon, the type it computes in
    for every dtype served here."""
    eps = getattr(module, _eps_of(module))
    return torch.finfo(torch.float32).eps if eps is None else float(eps)


def _fused(module, state, x):
    if state.block == "rmsnorm":
        return rms_norm(x, module._parameters["weight"], _eps(module))
    children = module._modules
    gate, up, down = (children[n] for n in state.names)
    return down(silu_mul(gate(x), up(x)))


def _agrees(fused: torch.Tensor, own) -> bool:
    """Each element of the fused result within CHECK_UNITS of the dtype's rounding of its own value plus its row's
    RMS (so that one large value or one row does not loosen the rest); non-finite values where the module's are.
    Compared a block of rows at a time: the fp32 temporaries stay near CHECK_CHUNK elements, whatever the output."""
    if not isinstance(own, torch.Tensor) or own.shape != fused.shape or own.dtype != fused.dtype:
        return False
    width = own.shape[-1] if own.dim() else 1
    own_rows, fused_rows = own.detach().reshape(-1, width), fused.detach().reshape(-1, width)
    step = max(1, CHECK_CHUNK // max(1, width))
    unit = torch.finfo(own.dtype).eps
    for first in range(0, own_rows.shape[0], step):
        o, f = own_rows[first:first + step].float(), fused_rows[first:first + step].float()
        finite = torch.isfinite(o)
        if not torch.equal(finite, torch.isfinite(f)):
            return False
        if not bool(((f == o) | (torch.isnan(f) & torch.isnan(o)))[~finite].all()):
            return False
        o, f = torch.where(finite, o, 0.0), torch.where(finite, f, 0.0)
        tol = CHECK_UNITS * unit * (o.abs() + o.square().mean(-1, keepdim=True).sqrt())
        if not bool(((f - o).abs() <= tol).all()):
            return False
    return True


def _probe(module, state, x) -> torch.Tensor:
    """Input of the library's own for the check, so that the caller's first batch cannot decide alone (a batch of
    zeros, of tiny or huge values, or with an outlier cannot tell SiLU from GELU, or w from 1 + w). An RMSNorm gets 8
    unit-normal rows. A gated MLP gets normal values of x's own shape (its products are tuned for that shape already,
    not for a new one), scaled so that the gate's output has unit RMS, where the activations differ most."""
    gen = torch.Generator(device=x.device).manual_seed(0)
    if state.block == "rmsnorm":
        return torch.randn((8, x.shape[-1]), generator=gen, device=x.device).to(x.dtype)
    probe = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
    gate_rms = getattr(module, state.names[0])(probe).float().square().mean().sqrt()
    return (probe.float() / gate_rms.clamp_min(1e-6)).to(x.dtype)


def _decline(module, state, x, key, why: str, own=None):
    state.verdicts[key] = "declined"
    counters.fused_declined(f"{state.block}:{why}")
    return own if own is not None else type(module).forward(module, x)


def _check(module, state, x, key):
    """The first call in this mode and dtype: the module's own forward and the fused path, both without grad, on the
    call's input and on a probe; then the call's result by the path chosen, once, with grad if the call needs it (so
    that a recomputation, under activation checkpointing, saves the same tensors as this call did)."""
    with torch.no_grad():
        own = type(module).forward(module, x)          # raises what the module raises: no verdict then
        try:
            probe = _probe(module, state, x)
            agrees = (_agrees(_fused(module, state, x), own)
                      and _agrees(_fused(module, state, probe), type(module).forward(module, probe)))
        except _PROPAGATED:
            raise
        except Exception as e:  # noqa: BLE001 - a fused kernel that fails leaves the module as it was
            failure = f"failed:{type(e).__name__}"
        else:
            failure = None if agrees else "differs"
    if failure is not None:
        return _decline(module, state, x, key, failure, own=None if torch.is_grad_enabled() else own)
    state.verdicts[key] = "fused"
    counters.bump("fused_blocks")
    return _fused(module, state, x)


def _snapshot(module) -> tuple:
    """What a gated MLP's verdicts rest on besides its class's code: its children, its plain attributes (an
    activation held as a function, a flag) and any forward assigned to a child. Compared by identity: a reassignment
    is a change."""
    children = tuple(module._modules.values())
    attributes = tuple(v for k, v in module.__dict__.items() if k[0] != "_" and k != "training")
    return children + attributes + tuple(c.__dict__.get("forward") for c in children)


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _fused_forward(module, state: BlockState, *args, **kwargs):
    if kwargs or len(args) != 1 or _tracing():
        return type(module).forward(module, *args, **kwargs)
    if state.block == "gated_mlp":
        snapshot = _snapshot(module)
        if not _same(snapshot, state.children):     # an activation or projection replaced: its verdicts no longer hold
            state.verdicts.clear()
            state.children = snapshot
    x = args[0]
    if not _servable(module, state, x):
        return type(module).forward(module, x)
    key = (module.training, x.dtype, x.is_cuda)
    verdict = state.verdicts.get(key)
    if verdict == "fused":
        try:
            return _fused(module, state, x)
        except _PROPAGATED:
            raise
        except Exception as e:  # noqa: BLE001 - a fused call that fails (a new width's compile, ...): if the
            own = type(module).forward(module, x)       # module's own forward fails too, that error is the caller's
            return _decline(module, state, x, key, f"failed:{type(e).__name__}", own=own)
    if verdict is not None or not _runs_here(x) or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return type(module).forward(module, x)
    return _check(module, state, x, key)


__all__ = ["BlockState", "fusable", "is_fused_forward", "patch_blocks", "rms_norm", "silu_mul"]
