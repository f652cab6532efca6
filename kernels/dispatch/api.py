"""User entry points: mm, int_mm, linear, explain, stats (and scaled_mm, from kernels.dispatch.scaled). Validation,
the warm dispatch tables (the C++ one, which api owns for every op, and the Python one), and the cold path."""
from __future__ import annotations

import dataclasses
import inspect

import torch
import torch.nn.functional as F

from kernels.core import counters as _stats
from kernels.core.cache_root import warn_once
from kernels.core.choice import Choice
from kernels.core.config import config, interpret_mode, on_selection_settings_change
from kernels.core.errors import InputTypeError, InputValueError
from kernels.core.problem import ACTIVATIONS, GemmProblem
from kernels.core.selection import Selection
from kernels.dispatch import dynamic as _dynamic
from kernels.dispatch import ops as _ops
from kernels.dispatch.out_arg import check_out, out_fits
from kernels.dispatch import record as _record
from kernels.dispatch import scaled as _scaled
from kernels.dispatch import selected
from kernels.native import fastpath as _fastpath
from backends.aten import epilogue_launch

_MM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ATEN = {"mm": torch.mm, "int_mm": torch._int_mm}

# warm path: fast key -> launch(a, b, out). Filled on the first call of each problem.
_dispatch: dict[tuple, object] = {}
_memory_hits = [0]
_generation = [0]       # bumped by clear_memory_cache: a cold call registers its winner only if it did not move
# calls that need grad (an input requires it, grad mode on, not traced): (warm key, which inputs require grad) -> the
# call: kernels' autograd Function, or torch's own function where the layer's winners (forward and backward products)
# save less GPU time over aten than the Function costs in host time (_torchs_autograd_serves): aten everywhere, or
# small wins that a host-bound training step would pay for. Entries are (call, C++ kind or None): torch's routes are
# mirrored into the C++ table (at::mm / at::linear under grad mode), kernels' Function stays here.
_grad_routes: dict[tuple, tuple] = {}
_FAST_TORCH_LINEAR_KIND = 6    # the C++ table's at::linear then the activation, for a grad route
_lock = selected.lock          # one lock for the warm table and the selections behind it
_fast = _fastpath.Fastpath()
_fast_call = None       # the C++ table's call(op, a, b) once loaded: the product, or None when it does not serve it
_fast_linear = None     # its call_linear(x, weight, bias, activation), set with _fast_call (which switches both)
_FAST_OP = {"mm": 0, "int_mm": 1}
_FAST_ATEN_KIND = {torch.mm: 0, torch._int_mm: 1}
_FAST_PYTHON_KIND = 2
_FAST_ADDMM_KIND = 4    # linear's aten_addmm, computed by the table itself (at::addmm / at::mm, the activation)

# kernels.scaled_mm, exported from here: importing api connects it to the C++ table (_scaled.connect, at the end)
scaled_mm = _scaled.scaled_mm


_FP32 = torch.float32
_FP64 = torch.float64
_AUTOCAST_DEVICES = ("cuda", "cpu")       # where kernels runs; torch.is_autocast_enabled("meta") raises
# one C call per call (autocast off is the common case); torch builds without it ask each device type
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled",
                        lambda: torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"))
# torch.func's transforms (vmap, grad, jacrev) hand ops wrappers without storage: kernels has no batching rule
functorch_wrapped = getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False)
_matmul_precision = torch.get_float32_matmul_precision
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling      # Dynamo folds it to True while tracing: the branch is in the graph
# torch.jit.trace records torch ops, not launches: a traced call takes the custom op (recorded as one node) as a
# compiled one does; checked after _compiling, so Dynamo never meets it
_jit_tracing = torch._C._is_tracing


def _fast_key(op: str, a, b) -> tuple:
    # everything GemmProblem is derived from, read as cheaply as torch allows (module-level aliases: no attribute
    # lookups on `torch` per call; the grad mode is only asked when an input requires grad)
    return (op, a.dtype, b.dtype, a.shape, b.shape, a.stride(), b.stride(), a.device, b.device,
            a.data_ptr() & 15, b.data_ptr() & 15, _matmul_precision() if a.dtype is _FP32 else None,
            (a.requires_grad or b.requires_grad) and _grad_enabled())


def mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, dynamic=None) -> torch.Tensor:
    """a @ b for 2-D fp16 / bf16 / fp32 tensors, with the fastest verified kernel for this problem.
    `dynamic`: dims whose size varies between calls ('m', 'm,k', kernels.Dynamic(...); None = KERNELS_DYNAMIC):
    one winner per size hint, each new shape served by one of them (see kernels.dispatch.dynamic).
    Differentiable, and traced by torch.compile as the custom op kernels::mm (kernels.dispatch.ops). Under
    torch.autocast the operands are cast as torch's autocast casts torch.mm's (out= calls, like torch.mm's, are not)."""
    if _compiling() or _jit_tracing():
        return _traced("mm", *_autocast(a, b) if out is None else (a, b), out)
    if out is None and _any_autocast():
        a, b = _autocast(a, b)
    if _fast_call is not None and out is None and dynamic is None:
        result = _fast_call(0, a, b)
        if result is not None:
            return result
    try:
        key = _fast_key("mm", a, b)
        entry = _dispatch.get(key if dynamic is None else _dynamic_key(key, dynamic))
    except (AttributeError, TypeError, RuntimeError):
        key = entry = None
    if entry is not None:
        if out is None:
            _memory_hits[0] += 1
            return entry[0](a, b)       # for aten winners this is torch.mm itself: no Python frame in between
        if out_fits(out, a, b, a.dtype):
            _memory_hits[0] += 1
            return entry[1](a, b, out)
    return _cold("mm", a, b, out, dynamic, key=key)


def int_mm(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None, dynamic=None) -> torch.Tensor:
    """a @ b for 2-D int8 tensors, exact, with an int32 result. `dynamic` as for mm."""
    # mirrors mm() line for line on purpose: a shared helper would add a Python call to every warm call
    if _compiling() or _jit_tracing():
        return _traced("int_mm", a, b, out)
    if _fast_call is not None and out is None and dynamic is None:
        result = _fast_call(1, a, b)
        if result is not None:
            return result
    try:
        key = _fast_key("int_mm", a, b)
        entry = _dispatch.get(key if dynamic is None else _dynamic_key(key, dynamic))
    except (AttributeError, TypeError, RuntimeError):
        key = entry = None
    if entry is not None:
        if out is None:
            _memory_hits[0] += 1
            return entry[0](a, b)
        if out_fits(out, a, b, torch.int32):
            _memory_hits[0] += 1
            return entry[1](a, b, out)
    return _cold("int_mm", a, b, out, dynamic, key=key)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
           activation: str | None = None) -> torch.Tensor:
    """activation(x @ weight.T + bias), as torch.nn.functional.linear (then the activation): x (..., K), weight
    (N, K) as nn.Linear stores it, bias (N,) or None, activation None / "relu" / "gelu" (tanh approximation) /
    "silu". fp16 / bf16 / fp32. The bias and activation are fused into the tuned kernel's epilogue; x of 3-D and
    more is flattened to 2-D without a copy when its strides allow.
    Differentiable, and traced by torch.compile as the custom op kernels::linear (kernels.dispatch.ops); under
    autograd the activation is not fused (torch applies it, so autograd differentiates it): fusion is for
    inference. Under torch.autocast x, weight and bias are cast as torch's autocast casts F.linear's."""
    if _compiling() or _jit_tracing():
        return _traced_linear(*_autocast(x, weight, bias), activation)
    if _any_autocast():
        x, weight, bias = _autocast(x, weight, bias)
    return _plain_linear(x, weight, bias, activation, route=True)


def _autocast(*tensors):
    """The operands as torch's autocast hands them to mm / linear (ops it runs in lower precision): each floating
    tensor but fp64, on a device type where autocast is on, cast to that device's autocast dtype; the rest as they
    are. Without it a fp32 call in an autocast region returned fp32 where torch's returns the autocast dtype -- or
    not, by which candidate won (aten's torch.mm casts itself)."""
    cast = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype is not _FP64:
            device = t.device.type
            if device in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device):
                dtype = torch.get_autocast_dtype(device)
                if t.dtype is not dtype:
                    t = t.to(dtype)
        cast.append(t)
    return cast


def _linear_key(x2, wt, bias, activation) -> tuple:
    """The warm table's key of a linear call on the 2-D views: mm's key of (x2, wt), the activation, and the bias's
    facts (its grad flag too: a call where only the bias needs grad must not take a no-grad entry)."""
    return (_fast_key("mm", x2, wt), activation, None if bias is None else
            (bias.dtype, bias.shape, bias.stride(), bias.device, bias.requires_grad and _grad_enabled()))


def _plain_linear(x, weight, bias, activation, route: bool = False):
    """The C++ table, the Python warm table, then the cold path. What kernels::linear runs (route=False: never the
    custom ops again); linear() calls it with route=True (grad calls go to kernels' autograd)."""
    if _fast_call is not None:
        result = _fast_linear(x, weight, bias, activation)
        if result is not None:
            return result
    try:
        x2 = _ops.as_2d(x)
        wt = weight.t()
        key = _linear_key(x2, wt, bias, activation)
        entry = _dispatch.get(key)
    except (AttributeError, TypeError, IndexError, RuntimeError):
        key = entry = None
    if entry is not None:
        _memory_hits[0] += 1
        out = entry[0](x2, wt) if bias is None else entry[0](x2, wt, bias)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[1])
    if route and key is not None:
        grad_route = _grad_routes.get((key, x.requires_grad, weight.requires_grad))
        if grad_route is not None:
            _memory_hits[0] += 1
            return grad_route[0](x, weight, bias)
    return _linear_cold(x, weight, bias, activation, route=route)


def _linear_cold(x, weight, bias, activation, route: bool = True):
    if _under_functorch(x, weight, bias):
        return _activate(F.linear(x, weight, bias), activation)
    if not _settings_checked:
        _check_settings()
    validate_linear(x, weight, bias, activation)
    if route and _needs_grad(x, weight, bias):
        return _grad_route_linear(x, weight, bias, activation)(x, weight, bias)
    if _fast_call is None:
        _fast.try_load(_fast_loaded)
    act = activation or ""
    x2 = _ops.as_2d(x)
    wt = weight.t()
    shape = (*x.shape[:-1], weight.shape[0])
    if 0 in (x2.shape[0], x2.shape[1], wt.shape[1]):
        return _trivial_linear(x2, wt, bias, act).view(shape)
    problem = GemmProblem.from_tensors("mm", x2, wt, bias=bias is not None, activation=act)
    operands = (x2, wt) if bias is None else (x2, wt, bias)
    if x.device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()):
        with selected.device_context(x):
            launch = selected.resolved(problem) or _linear_aten(problem)
            return launch(*operands, None).view(shape)
    generation = _generation[0]
    aten = _cpu_fallback(x)
    if aten:
        launch = _linear_aten(problem)
        _stats.bump("cpu_fallbacks")
    else:
        with selected.device_context(x):
            launch = _record.resolve(problem)
        aten = selected.aten_winner(problem)
    direct = _direct(launch, len(operands))
    if bias is not None and bias.stride(0) != 1:        # kernels read the bias as a contiguous vector
        contiguous = direct
        direct = lambda a, b, c: contiguous(a, b, c.contiguous())    # noqa: E731
        operands = (x2, wt, bias.contiguous())
    key = _linear_key(x2, wt, bias, activation)
    kind = _FAST_ADDMM_KIND if aten and problem.epilogue else _FAST_ATEN_KIND.get(direct, _FAST_PYTHON_KIND)
    with selected.device_context(x):       # the C++ table's plan is made for the operands' device, not the current one
        with _lock:
            if generation == _generation[0]:
                _dispatch[key] = entry = (direct, launch, kind)
                if _fast.module is not None:
                    _fast_register(_fast.module, key, entry)
                if len(_dispatch) > config.max_problems:
                    _shrink(config.max_problems)
        return direct(*operands).view(shape)


def _linear_aten(problem: GemmProblem):
    return _aten_launch("mm") if not problem.epilogue else epilogue_launch(problem)


def _direct(launch, n_operands: int):
    """launch(*operands) without `out`: `.direct` when the launch has one, else a wrapper passing out=None."""
    if n_operands == 2:
        return _two_arg(launch)
    direct = getattr(launch, "direct", None)
    return direct if direct is not None else (lambda a, b, bias: launch(a, b, bias, None))


def _activate(out: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(out)
    if activation == "gelu":
        return F.gelu(out, approximate="tanh")
    if activation == "silu":
        return F.silu(out)
    return out


def _trivial_linear(x2, wt, bias, activation: str) -> torch.Tensor:
    """A zero-size dimension: an empty result, or (K == 0) the bias broadcast, then the activation."""
    out = torch.zeros(x2.shape[0], wt.shape[1], dtype=x2.dtype, device=x2.device)
    if bias is not None:
        out += bias
    return _activate(out, activation)


def _two_arg(launch):
    """launch(a, b) for calls without `out`: the torch function itself for aten winners (they carry it as
    `.direct`), the launcher when it accepts two arguments, else a wrapper passing out=None."""
    direct = getattr(launch, "direct", None)
    if direct is not None:
        return direct
    try:
        inspect.signature(launch).bind(None, None)
        return launch
    except (TypeError, ValueError):
        return lambda a, b: launch(a, b, None)


# -- validation ------------------------------------------------------------------------------------------------
def _dtype_list(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def validate(op: str, a, b, out=None) -> None:
    """Raise InputTypeError / InputValueError naming exactly what is wrong with the arguments."""
    if op not in _ATEN:
        raise InputValueError(f"unknown op {op!r}; expected 'mm', 'int_mm', 'linear' or 'scaled_mm'")
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"kernels.{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise InputValueError(f"kernels.{op}: {name} must be 2-D, got {t.dim()}-D with shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0]:
        raise InputValueError(f"kernels.{op}: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)}"
                              f" (a.shape[1]={a.shape[1]} != b.shape[0]={b.shape[0]})")
    if a.device != b.device:
        raise InputValueError(f"kernels.{op}: a and b are on different devices ({a.device} and {b.device})")
    if a.device.type not in ("cuda", "cpu"):
        raise InputValueError(f"kernels.{op}: tensors on {a.device} are not supported (cuda or cpu)")
    if op == "mm":
        if a.dtype == torch.int8 or b.dtype == torch.int8:
            raise InputTypeError("kernels.mm: int8 inputs belong to kernels.int_mm (int8 x int8 -> int32)")
        for name, t in (("a", a), ("b", b)):
            if t.dtype not in _MM_DTYPES:
                raise InputTypeError(f"kernels.mm: {name} has unsupported dtype {t.dtype}; supported: "
                                     f"{_dtype_list(_MM_DTYPES)}")
        if a.dtype != b.dtype:
            raise InputTypeError(f"kernels.mm: a and b dtypes differ ({a.dtype} and {b.dtype})")
        out_dtype = a.dtype
    else:
        for name, t in (("a", a), ("b", b)):
            if t.dtype != torch.int8:
                raise InputTypeError(f"kernels.int_mm: {name} must be int8, got {t.dtype}" +
                                     (" (floating-point inputs belong to kernels.mm)" if t.dtype.is_floating_point
                                      else ""))
        out_dtype = torch.int32
    if out is not None:
        check_out(op, out, (a.shape[0], b.shape[1]), out_dtype, a.device, {"a": a, "b": b})


def validate_linear(x, weight, bias, activation) -> None:
    """Raise InputTypeError / InputValueError naming the argument of kernels.linear that is wrong."""
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"kernels.linear: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise InputTypeError(f"kernels.linear: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if activation is not None and not isinstance(activation, str):
        raise InputTypeError(f"kernels.linear: activation must be None or a string (one of {', '.join(ACTIVATIONS)}), "
                             f"not {type(activation).__name__}")
    if activation is not None and activation not in ACTIVATIONS:
        raise InputValueError(f"kernels.linear: unknown activation {activation!r}; expected None or one of "
                              f"{', '.join(repr(a) for a in ACTIVATIONS)}")
    if weight.dim() != 2:
        raise InputValueError(f"kernels.linear: weight must be 2-D (out_features, in_features), got "
                              f"{weight.dim()}-D with shape {tuple(weight.shape)}")
    if x.dim() < 1:
        raise InputValueError("kernels.linear: x must have at least one dimension (..., in_features), got a scalar")
    if x.shape[-1] != weight.shape[1]:
        raise InputValueError(f"kernels.linear: x's last dimension is {x.shape[-1]} but weight has in_features "
                              f"{weight.shape[1]} (x {tuple(x.shape)}, weight {tuple(weight.shape)})")
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in _MM_DTYPES:
            raise InputTypeError(f"kernels.linear: {name} has unsupported dtype {t.dtype}; supported: "
                                 f"{_dtype_list(_MM_DTYPES)}")
    if x.dtype != weight.dtype:
        raise InputTypeError(f"kernels.linear: x and weight dtypes differ ({x.dtype} and {weight.dtype})")
    if x.device != weight.device:
        raise InputValueError(f"kernels.linear: x and weight are on different devices ({x.device} and "
                              f"{weight.device})")
    if x.device.type not in ("cuda", "cpu"):
        raise InputValueError(f"kernels.linear: tensors on {x.device} are not supported (cuda or cpu)")
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise InputValueError(f"kernels.linear: bias must have shape ({weight.shape[0]},) (out_features), got "
                                  f"{tuple(bias.shape)}")
        if bias.dtype != x.dtype:
            raise InputTypeError(f"kernels.linear: bias has dtype {bias.dtype}, expected {x.dtype} (x's dtype)")
        if bias.device != x.device:
            raise InputValueError(f"kernels.linear: bias is on {bias.device}, x on {x.device}")


# -- cold path -------------------------------------------------------------------------------------------------
def _aten_launch(op: str):
    fn = _ATEN[op]

    def launch(a, b, out=None):
        return fn(a, b) if out is None else fn(a, b, out=out)

    launch.direct = fn
    return launch


def _dense_int_mm(a, b, out=None):
    """torch._int_mm on the CPU with broadcast operands copied first: torch's CPU kernel misreads a stride of 0
    (torch 2.13: sums off by up to ~1e9, not the same twice)."""
    return torch._int_mm(a.contiguous(), b.contiguous(), **({} if out is None else {"out": out}))


def _trivial(op, a, b, out):
    """Zero-size dims: an empty result, or zeros when only K is zero."""
    shape = (a.shape[0], b.shape[1])
    dtype = torch.int32 if op == "int_mm" else a.dtype
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=a.device)
    return out.zero_()


def _cpu_fallback(a) -> bool:
    return a.device.type == "cpu" and not interpret_mode()


def _cold(op: str, a, b, out, dynamic=None, route: bool = True, key: tuple | None = None):
    """`key`: the call's _fast_key when the caller has made it (mm(), int_mm()), else None."""
    if _under_functorch(a, b):
        return _aten_launch(op)(a, b, out)
    if not _settings_checked:
        _check_settings()
    if route and op == "mm" and out is None and key is not None:
        # a grad call (their keys never reach the warm tables) met before: its route, without validating again
        grad_route = _grad_routes.get((key, a.requires_grad, b.requires_grad))
        if grad_route is not None:
            _memory_hits[0] += 1
            return grad_route[0](a, b)
    validate(op, a, b, out)
    if route and op == "mm" and _needs_grad(a, b):
        # torch.mm decides about out= under autograd (it refuses it, as for any out= op)
        return _grad_route_mm(a, b)(a, b) if out is None else torch.mm(a, b, out=out)
    if _fast_call is None:
        _fast.try_load(_fast_loaded)
    dyn = _dynamic.resolve(dynamic)
    if 0 in (a.shape[0], a.shape[1], b.shape[1]):
        return _trivial(op, a, b, out)
    key = key or _fast_key(op, a, b)
    if dynamic is not None:
        key = _dynamic_key(key, dynamic)
    if a.device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()):
        return _under_capture(op, a, b, out)
    generation = _generation[0]
    if _cpu_fallback(a):
        launch = _aten_launch(op) if op != "int_mm" or 0 not in (*a.stride(), *b.stride()) else _dense_int_mm
        _stats.bump("cpu_fallbacks")
    else:
        problem = GemmProblem.from_tensors(op, a, b)
        with selected.device_context(a):
            launch = _record.resolve(problem, dyn)
    with selected.device_context(a):       # the C++ table's plan is made for the operands' device, not the current one
        with _lock:
            if generation == _generation[0]:
                _dispatch[key] = entry = (_two_arg(launch), launch)
                if dynamic is None and _fast.module is not None:
                    _fast_register(_fast.module, key, entry)
                if len(_dispatch) > config.max_problems:
                    _shrink(config.max_problems)
        return launch(a, b, out)


def _dynamic_key(key: tuple, dynamic) -> tuple:
    """A dynamic call's warm key: the argument with its type, since 1 == True but only True is a valid `dynamic`
    (resolve refuses 1). A 2-tuple, which the C++ table declines (_fast_register)."""
    return key, (type(dynamic), dynamic)


_settings_checked = False


def _check_settings() -> None:
    """Every setting read once, at the process's first cold call: a bad value fails there, naming the variable,
    not at whichever later call first tunes a problem (a warm cache served typos silently until then)."""
    global _settings_checked
    config.validate()
    _settings_checked = True


def _under_functorch(*tensors) -> bool:
    """Whether a torch.func transform wraps an operand: then the call is torch's (which batches and differentiates
    it), counted as a pass-through. (The warm paths never match such a call: it has no data pointer to key on.)"""
    if any(isinstance(t, torch.Tensor) and functorch_wrapped(t) for t in tensors):
        _stats.passthrough("functorch")
        return True
    return False


# -- routed calls: autograd and torch.compile go through the custom ops ------------------------------------------
def _needs_grad(*tensors) -> bool:
    return _grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _traced(op: str, a, b, out):
    """mm / int_mm while torch.compile traces: validated here (the trace specializes on what validation reads),
    then one custom op in the graph; `out` gets a copy of the result."""
    validate(op, a, b, out)
    result = _custom.mm(a, b) if op == "mm" else _custom.int_mm(a, b)
    return result if out is None else out.copy_(result)


def _traced_linear(x, weight, bias, activation):
    validate_linear(x, weight, bias, activation)
    return _routed_linear(x, weight, bias, activation)


def _routed_linear(x, weight, bias, activation):
    """kernels::linear while traced, an eager autograd.Function otherwise (same products, without the op's dispatch
    cost); when autograd needs the result and there is an activation, the product runs without it and the
    activation is torch's (autograd saves what it needs and differentiates it): fusion is for inference."""
    product = _custom.linear if _compiling() or _jit_tracing() else _custom.eager_linear
    if activation and _needs_grad(x, weight, bias):
        return _activate(product(x, weight, bias, None), activation)
    return product(x, weight, bias, activation)


def _grad_route_mm(a, b):
    """The route of a validated mm call that needs grad (see _grad_routes), registered for the next ones."""
    needs = (a.requires_grad, b.requires_grad)
    if not _routable(a, (a.shape[0], a.shape[1], b.shape[1])):
        return _custom.eager_mm
    problems = [GemmProblem.from_tensors("mm", a, b), *_ops.mm_backward_problems(a, b, needs)]
    key = (_fast_key("mm", a, b), *needs)
    if _torchs_autograd_serves(a, problems):
        _stats.bump("torch_autograd")
        return _add_grad_route(key, torch.mm, _FAST_ATEN_KIND[torch.mm])
    return _add_grad_route(key, _custom.eager_mm)


def _grad_route_linear(x, weight, bias, activation):
    """The route of a validated linear call that needs grad: call(x, weight, bias). The activation is torch's
    either way (autograd differentiates it from its own saved input): fusion is for inference."""
    kernels_autograd = lambda x, weight, bias: _routed_linear(x, weight, bias, activation)   # noqa: E731
    x2 = _ops.as_2d(x)
    wt = weight.t()
    if not _routable(x, (x2.shape[0], x2.shape[1], wt.shape[1])):
        return kernels_autograd
    needs = (x.requires_grad, weight.requires_grad)
    problems = [GemmProblem.from_tensors("mm", x2, wt, bias=bias is not None),
                *_ops.linear_backward_problems(x, weight, needs)]
    key = (_linear_key(x2, wt, bias, activation), *needs)
    if not _torchs_autograd_serves(x, problems):
        return _add_grad_route(key, kernels_autograd)
    _stats.bump("torch_autograd")
    call = F.linear if not activation else lambda x, weight, bias: _activate(F.linear(x, weight, bias), activation)
    return _add_grad_route(key, call, _FAST_TORCH_LINEAR_KIND)


def _routable(like: torch.Tensor, mnk) -> bool:
    """Whether a grad call's route may be worked out and kept now: not for a zero-size product (nothing to tune),
    nor while a CUDA graph is being captured (a tune there would be recorded: kernels' autograd serves the call)."""
    return 0 not in mnk and not (like.device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _torchs_autograd_serves(like: torch.Tensor, problems: list[GemmProblem]) -> bool:
    """Resolve the forward product (problems[0]; its failure is the caller's, as on any cold call) and look the
    backward ones up ahead (never raising: the backward looks a failed one up again); then whether torch's own
    autograd is to serve the calls: on the CPU fallback (every product is torch's), or where the winners save less
    GPU time over aten than kernels' autograd Function costs in host time (ops.FUNCTION_HOST_US; aten everywhere
    saves nothing). Not while a product's duel runs on calls (KERNELS_DUEL=calls): kernels' autograd serves, so the
    duel gets its calls, until a verdict drops the routes (_forget_warm) and the next call decides again (torch's
    autograd took every call of a layer whose provisional winners were aten, and its 12 duels never ended)."""
    if _fast_call is None:          # a training-only process meets no other cold path that would load it
        _fast.try_load(_fast_loaded)
    if _cpu_fallback(like):
        _stats.bump("cpu_fallbacks")
        return True
    with selected.device_context(like):
        _record.resolve(problems[0])
    for problem in problems[1:]:
        _prepare(problem, like)
    selections = [selected.selection(p) for p in problems]
    if any(sel is not None and sel.awaiting_calls for sel in selections):
        return False
    return _ops.kernels_gain_us(selections) <= _ops.FUNCTION_HOST_US


def _add_grad_route(key: tuple, call, fast_kind: int | None = None):
    """Keep a grad call's route; torch's (fast_kind: the C++ kind computing it) goes into the C++ table too."""
    with _lock:
        _grad_routes[key] = (call, fast_kind)
        if _fast.module is not None and fast_kind is not None:
            _fast.module.add(key, fast_kind, call)
        if len(_grad_routes) > config.max_problems:
            for old in list(_grad_routes)[:len(_grad_routes) - max(1, config.max_problems // 2)]:
                del _grad_routes[old]
            _remirror()
    return call


def _plain(op: str):
    """The warm table or the cold path for op, never the custom ops: what kernels::mm / kernels::int_mm run."""
    fast_op = _FAST_OP[op]

    def product(a, b):
        if _fast_call is not None:
            result = _fast_call(fast_op, a, b)
            if result is not None:
                return result
        entry = _dispatch.get(_fast_key(op, a, b))
        if entry is not None:
            _memory_hits[0] += 1
            return entry[0](a, b)
        return _cold(op, a, b, None, route=False)

    return product


# the routed calls' ops, around the plain products above (registered with torch.library on first use)
def _prepare(problem: GemmProblem, like: torch.Tensor) -> None:
    """Look a product up ahead of its call (ops.BackwardAhead): the cold path's resolve, on the device of `like` (an
    operand of the call to come). Not on the CPU fallback (nothing to tune), nor while a CUDA graph is being captured
    (a tune there would be recorded); a failure is the later call's to meet, never the caller's now."""
    if _cpu_fallback(like) or (like.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return
    try:
        with selected.device_context(like):
            _record.resolve(problem)
    except Exception as e:  # noqa: BLE001 - looked up again (and reported) when the backward calls it
        warn_once(f"ahead:{problem.short()}", f"kernels: the backward product {problem.short()} could not be "
                  f"looked up ahead ({type(e).__name__}: {e}); the backward will look it up", stacklevel=2)


_custom = _ops.CustomOps(_ops.Plain(mm=_plain("mm"), int_mm=_plain("int_mm"), linear=_plain_linear,
                                    prepare=_prepare, max_problems=lambda: config.max_problems,
                                    defined=lambda: _ops.bind_native(_fast.module)))


def _under_capture(op: str, a, b, out):
    """A cold call inside a CUDA-graph capture or a torch.compile trace: a problem this process has resolved is
    served by its launcher; anything else (a tune, or a stored winner not yet verified here: both sync and allocate)
    by aten for this call, and resolved on a later call outside the capture."""
    problem = GemmProblem.from_tensors(op, a, b)
    with selected.device_context(a):
        launch = selected.resolved(problem) or _aten_launch(op)
        return launch(a, b, out)


def _shrink(limit: int) -> None:
    """Keep the warm table within `limit` problems: drop the oldest-added half (a problem that comes back is looked
    up again, cheaply, and goes to the back), and the same in the tables behind it. Insertion order stands in for
    recency so warm calls pay nothing for the bookkeeping."""
    keep = max(1, limit // 2)
    for key in list(_dispatch)[:len(_dispatch) - keep]:
        del _dispatch[key]
    _remirror()
    selected.trim(keep)
    _dynamic.trim(keep)


def _remirror() -> None:
    """The C++ table again from the Python ones (after entries were dropped from them)."""
    if _fast.module is not None:
        _fast.module.clear()
        for key, entry in _dispatch.items():
            _fast_register(_fast.module, key, entry)
        _mirror_grad_routes(_fast.module)
        _scaled.mirror(_fast.module)


def _mirror_grad_routes(module) -> None:
    for key, (call, fast_kind) in _grad_routes.items():
        if fast_kind is not None:
            module.add(key, fast_kind, call)


def _fast_register(module, key: tuple, entry: tuple) -> None:
    """Mirror one warm entry into the C++ table; it declines keys it does not serve (fp32, grad, dynamic calls'
    (key, (type, dynamic)), a linear bias it would not pass as is). Entries are (direct, launch) for mm / int_mm, whose
    kind follows from direct (torch's own function: computed in C++), and (direct, launch, kind) for linear."""
    kind = entry[2] if len(entry) > 2 else _FAST_ATEN_KIND.get(entry[0], _FAST_PYTHON_KIND)
    module.add(key, kind, entry[0])


def _fast_loaded(module) -> None:
    """The C++ table just loaded (maybe from the background build): copy every warm entry into it, then route
    warm calls through it."""
    global _fast_call, _fast_linear
    with _lock:
        for key, entry in list(_dispatch.items()):
            _fast_register(module, key, entry)
        _mirror_grad_routes(module)
        _scaled.table_loaded(module)
        _fast_linear = module.call_linear
        _fast_call = module.call
    _ops.bind_native(module)        # the ops' dispatcher kernels, if the ops are defined (else when they are)


def _load_fast() -> None:
    """Load the C++ table as config.fastpath says unless it is loaded (kernels.scaled_mm's cold calls ask)."""
    if _fast_call is None:
        _fast.try_load(_fast_loaded)


# -- introspection ---------------------------------------------------------------------------------------------
_TORCH_NAME = {"aten_mm": "torch.mm", "aten_int_mm": "torch._int_mm", "aten_addmm": "torch.addmm and the activation"}


def explain(a: torch.Tensor, b: torch.Tensor, op: str = "mm", dynamic=None, *, bias: torch.Tensor | None = None,
            activation: str | None = None, scale_a: torch.Tensor | None = None, scale_b: torch.Tensor | None = None,
            out_dtype: torch.dtype = torch.bfloat16) -> Selection:
    """The Selection for this problem (tuning it first if needed); `.source` says where it came from this time.
    For a dynamic problem: the serving hint winner's Selection, its first note saying which hint and why.
    op="linear": `a` is x and `b` the weight as kernels.linear takes them, with its bias and activation.
    op="scaled_mm": as kernels.scaled_mm takes them, with scale_a, scale_b, bias and out_dtype."""
    if op == "scaled_mm":
        if scale_a is None or scale_b is None:      # else kernels.scaled_mm's own message, naming no explain argument
            raise InputValueError("explain: op='scaled_mm' needs scale_a= and scale_b=, as kernels.scaled_mm takes "
                                  "them")
        return _scaled.explain(a, b, scale_a, scale_b, bias, out_dtype)
    if op != "linear" and (bias is not None or activation is not None):     # else silently the plain product's
        raise InputValueError(f"explain: bias and activation describe op='linear' (or bias op='scaled_mm'), not "
                              f"op={op!r}")
    if scale_a is not None or scale_b is not None:
        raise InputValueError(f"explain: scale_a and scale_b describe op='scaled_mm', not op={op!r}")
    if out_dtype is not torch.bfloat16:     # the default: scaled_mm's alone takes another
        raise InputValueError(f"explain: out_dtype describes op='scaled_mm', not op={op!r}")
    if op == "linear" and dynamic is not None and _dynamic.resolve(dynamic) is not None:     # '' / () / False: static
        raise InputValueError("explain: kernels.linear's problems are never dynamic; dynamic= describes op='mm' or "
                              "'int_mm'")
    if op == "linear":
        validate_linear(a, b, bias, activation)
        a, b = _ops.as_2d(a), b.t()
        problem = GemmProblem.from_tensors("mm", a, b, bias=bias is not None, activation=activation or "")
    else:
        validate(op, a, b)
        problem = GemmProblem.from_tensors(op, a, b)
    dyn = _dynamic.resolve(dynamic) if op != "linear" else None
    if 0 in (problem.m, problem.n, problem.k) or _cpu_fallback(a):
        name = "aten_int_mm" if op == "int_mm" else "aten_addmm" if problem.epilogue else "aten_mm"
        why = ("zero-size dimension: the result is empty or zeros, nothing to tune" if 0 in (problem.m, problem.n,
               problem.k) else f"CPU tensors: computed with {_TORCH_NAME[name]} (set TRITON_INTERPRET=1 to run the "
               f"Triton templates through the interpreter)")
        return Selection(problem=problem, winner=name, choices={name: Choice("aten", name, problem.dtype)},
                         timings={}, source="cpu-fallback" if _cpu_fallback(a) else "trivial", notes=[why])
    if dyn is not None:
        with selected.device_context(a):
            return _dynamic.explain(problem, dyn)
    sel = selected.selection(problem)
    if sel is not None:
        return dataclasses.replace(sel, source="memory")
    with selected.device_context(a):
        _record.resolve(problem)
    return selected.selection(problem)


def stats() -> dict[str, int]:
    """Counters since process start: compiles, artifact loads, benchmarks, tunes, memory/disk hits, cpu fallbacks,
    pass-throughs and kernels.patch's fused blocks (each with its reasons);
    and `duels_pending`: the problems whose final round runs on their calls now (KERNELS_DUEL=calls: a duel, or
    candidates still to measure), not a counter."""
    snap = _stats.snapshot()
    snap["duels_pending"] = selected.duels_pending()
    snap["memory_hits"] = (_memory_hits[0] + _scaled.memory_hits[0]
                           + (_fast.module.hits() if _fast.module is not None else 0))
    return snap


def fastpath_status() -> str:
    """'loaded' when warm calls go through the C++ table (kernels.fastpath), else why they do not."""
    return "loaded" if _fast_call is not None else _fast.why_not


def load_fastpath(wait: bool = True) -> str:
    """Load the C++ warm-call table now rather than on the first tune (building it as config.fastpath says; 'auto'
    builds in the background, `wait` joins that build). Returns fastpath_status()."""
    _fast.try_load(_fast_loaded)
    if wait:
        _fast.wait()
    return fastpath_status()


def clear_memory_cache() -> None:
    """Forget in-process selections and launchers (the persistent store is untouched). A cold call that resolved
    its winner before this does not register it after (the generation moved): it may have been chosen under a
    setting that has changed since."""
    with _lock:
        _forget_warm()
        _custom.ahead.forget()
        selected.clear()
        _dynamic.clear()


def _forget_warm() -> None:
    """A duel on calls was decided (kernels.dispatch.call_duel): the warm tables and grad routes held its CallDuel,
    which delegates to the winner from then on. Dropped, each warm problem's next call looks its launcher up again
    (in memory, cheaply) and registers the winner's own: torch.mm's C++ kind, a native launch; a layer's grad route is
    decided again with the verdict in."""
    with _lock:
        _generation[0] += 1
        _dispatch.clear()
        _grad_routes.clear()
        if _fast.module is not None:
            _fast.module.clear()
        _scaled.clear()


_scaled.connect(_load_fast)
selected.on_duel_settled(_forget_warm)
# a selection setting changed in code: what this process selected under the old value must not serve the next call
on_selection_settings_change(clear_memory_cache)
