"""`kernels.patch(model)`: every nn.Linear of a model computes through kernels.linear, and its RMSNorm and gated-MLP
blocks through fused kernels (kernels.dispatch.fused; `fuse=False` leaves them alone); `kernels.unpatch(model)`
undoes it exactly.

How: an instance-level `forward` (a functools.partial of `_linear_forward` bound to the layer: picklable and
deep-copyable, unlike a bound method stored on the instance) shadows nn.Linear.forward; unpatch deletes it, so the
class's forward serves again. Only layers whose forward is nn.Linear's own are patched (a subclass with its own
forward, a LoRA layer say, computes something else), and only those without an instance-level forward already
(someone else's override is left alone, and left there by unpatch).

A call the library does not serve (fp64, a tensor subclass, a sparse input, ...) runs F.linear unchanged and is
counted in kernels.stats() as a pass-through with its reason (kernels.dispatch.mode). patch itself never raises on a
model: what it cannot serve it leaves to torch at call time.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kernels.core.errors import InputTypeError
from kernels.dispatch import api, fused
from kernels.dispatch.mode import INPUT_ERRORS, count_passthrough, dense, linear_unserved


def _linear_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    # kernels.linear validates the rest itself; the reason is worked out only for a call it refuses (warm calls
    # pay for two checks, not for linear_unserved's dozen)
    if dense(input) and dense(weight) and (bias is None or dense(bias)):
        try:
            return api.linear(input, weight, bias)
        except INPUT_ERRORS:
            pass
    count_passthrough(linear_unserved(input, weight, bias) or "refused")
    return F.linear(input, weight, bias)


def _is_patched(module: nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _linear_forward


def _check_model(model, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise InputTypeError(f"kernels.{what}: model must be a torch.nn.Module, got {type(model).__name__}")


def patch(model: nn.Module, *, fuse: bool = True) -> nn.Module:
    """Route every nn.Linear in `model` (itself included) through kernels.linear; with `fuse`, also run its RMSNorm
    and SiLU-gated MLP blocks through fused kernels, each once its first call agrees with its own forward
    (kernels.dispatch.fused); `fuse=False` leaves (or makes) them unfused. Returns `model`. Idempotent."""
    _check_model(model, "patch")
    if not isinstance(fuse, bool):
        raise InputTypeError(f"kernels.patch: fuse must be True or False, got {fuse!r}")
    for module in model.modules():
        if (isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward
                and "forward" not in module.__dict__):
            module.forward = functools.partial(_linear_forward, module)
    if fuse:
        fused.patch_blocks(model)
    else:       # fuse=False on a model patched with fusion before: its blocks compute their own forward again
        for module in model.modules():
            if fused.is_fused_forward(module.__dict__.get("forward")):
                del module.forward
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Undo kernels.patch on every layer of `model`: each forward is its class's again. Returns `model`."""
    _check_model(model, "unpatch")
    for module in model.modules():
        if _is_patched(module) or fused.is_fused_forward(module.__dict__.get("forward")):
            del module.forward
    return model
