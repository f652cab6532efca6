"""kernels.scaled_mm: fp8 products with torch._scaled_mm's semantics, tuned, verified, stored and dispatched like mm.

a (M, K) float8_e4m3fn (or float8_e5m2) row-major, b (K, N) float8_e4m3fn column-major (what torch._scaled_mm
takes: both K-major, as Hopper's fp8 tensor cores read them), fp32 scales per tensor (one element each) or row-wise
(scale_a (M, 1), scale_b (1, N)), an optional (N,) bias of the output dtype, output bf16 / fp16 / fp32:
out = (a @ b) * scale_a * scale_b + bias, accumulated in fp32, the scales applied once per output element.

Warm calls without `out` go through the C++ table (kernels/native/csrc/fastpath.cpp: call_scaled_mm, keyed by a's
and b's facts under an op code per scaling, bias and out dtype; it checks the scales and the bias on each call and
runs at::_scaled_mm, a native Triton launch or the winner's Python launch), then this module's own table, then the
cold path. Not differentiable (inference: torch._scaled_mm has no backward either); under torch.compile the call is
torch._scaled_mm itself, which Inductor lowers with its own templates.
"""
from __future__ import annotations

import dataclasses

import torch

from kernels.core import counters as _stats
from kernels.core.choice import Choice
from kernels.core.config import config, interpret_mode
from kernels.core.errors import InputTypeError, InputValueError
from kernels.core.problem import DTYPE_NAMES, SCALED_MULTIPLE, GemmProblem
from kernels.core.selection import Selection
from kernels.dispatch import record as _record
from kernels.dispatch import selected
from kernels.dispatch.out_arg import check_out, out_fits
from backends.aten import scaled_mm_launch

FP8_A = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_B = (torch.float8_e4m3fn,)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_dispatch: dict[tuple, object] = {}      # warm key -> launch(a, b, scale_a, scale_b[, bias], out)
memory_hits = [0]
_compiling = torch.compiler.is_compiling


def _no_table() -> None:
    return None


# The C++ table is api's (one table for every op, loaded once per process): api connects this module when it is
# imported (kernels.scaled_mm is exported through api so that it always is), calls table_loaded(module) when the
# table loads and mirror(module) when it refills it.
_fast_entries: dict[tuple, tuple[int, object]] = {}    # the C++ table's key -> (kind, launch): kept to refill it
_table = None                   # the loaded C++ module, or None
_fast_call = None               # its call_scaled_mm(a, b, scale_a, scale_b, bias, out_dtype): the product or None
_load_table = _no_table         # api's: load the table as config.fastpath says (it calls table_loaded when it has)
FAST_PYTHON_KIND = 2            # the C++ table calls the launch (a NativeLaunch: launched there, without Python)
FAST_ATEN_KIND = 5              # the C++ table calls at::_scaled_mm itself


def _key(a, b, scale_a, scale_b, bias, out_dtype) -> tuple:
    # every fact validation reads and the problem is derived from: a warm hit is a call validation would pass
    return (a.dtype, b.dtype, a.shape, b.shape, a.stride(), b.stride(), a.device, b.device, a.data_ptr() & 15,
            b.data_ptr() & 15, out_dtype, scale_a.dtype, scale_a.shape, scale_a.stride(), scale_a.device,
            scale_b.dtype, scale_b.shape, scale_b.stride(), scale_b.device,
            None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.device, bias.requires_grad),
            a.requires_grad or b.requires_grad or scale_a.requires_grad or scale_b.requires_grad)


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, *,
              bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b (+ bias) for fp8 a, b with fp32 scales per tensor or row-wise, as
    torch._scaled_mm computes it, with the fastest verified kernel for this problem."""
    if _compiling() or torch._C._is_tracing():    # traced (Dynamo or torch.jit.trace): torch's own op in the graph
        return torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype, out=out)
    if _fast_call is not None and out is None:
        result = _fast_call(a, b, scale_a, scale_b, bias, out_dtype)
        if result is not None:
            return result
    try:
        launch = _dispatch.get(_key(a, b, scale_a, scale_b, bias, out_dtype))
    except (AttributeError, TypeError):
        launch = None
    if launch is not None and (out is None or out_fits(out, a, b, out_dtype, scale_a, scale_b, bias)):
        memory_hits[0] += 1
        return (launch(a, b, scale_a, scale_b, out) if bias is None else
                launch(a, b, scale_a, scale_b, bias, out))
    return _cold(a, b, scale_a, scale_b, bias, out_dtype, out)


def _fast_key(a, b, scaling: str, bias, out_dtype) -> tuple:
    """The C++ table's key of a validated call: api's mm key fields for (a, b) under op "scaled_mm" (no fp32
    precision, no grad), then what picks the kernel besides (scaling, bias present, out dtype). The scales' and the
    bias's own facts are checked on each call there, not keyed."""
    return (("scaled_mm", a.dtype, b.dtype, a.shape, b.shape, a.stride(), b.stride(), a.device, b.device,
             a.data_ptr() & 15, b.data_ptr() & 15, None, False), scaling, bias is not None, out_dtype)


# -- validation ------------------------------------------------------------------------------------------------
def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def scaling_of(a, b, scale_a, scale_b) -> str:
    """'tensor' or 'row' for scales of valid shapes, else raises naming the scale that is wrong."""
    m, n = a.shape[0], b.shape[1]
    if scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() <= 2 and scale_b.dim() <= 2:
        return "tensor"
    if tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n):
        return "row"
    raise InputValueError(f"kernels.scaled_mm: scales must both be per-tensor (one element each) or row-wise "
                          f"(scale_a ({m}, 1) and scale_b (1, {n})); got scale_a {tuple(scale_a.shape)} and scale_b "
                          f"{tuple(scale_b.shape)}")


def validate(a, b, scale_a, scale_b, bias, out_dtype, out) -> str:
    """Raise InputTypeError / InputValueError naming the argument that is wrong; returns the scaling."""
    for name, t in (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b)):
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"kernels.scaled_mm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise InputTypeError(f"kernels.scaled_mm: bias must be a torch.Tensor or None, got {type(bias).__name__}")
    if not isinstance(out_dtype, torch.dtype) or out_dtype not in OUT_DTYPES:
        raise InputTypeError(f"kernels.scaled_mm: out_dtype must be one of {_names(OUT_DTYPES)}, got {out_dtype}")
    for name, t in (("a", a), ("b", b)):
        if t.dim() != 2:
            raise InputValueError(f"kernels.scaled_mm: {name} must be 2-D, got {t.dim()}-D with shape "
                                  f"{tuple(t.shape)}")
    if a.dtype not in FP8_A:
        raise InputTypeError(f"kernels.scaled_mm: a must be one of {_names(FP8_A)}, got {a.dtype}")
    if b.dtype not in FP8_B:
        raise InputTypeError(f"kernels.scaled_mm: b must be {_names(FP8_B)}, got {b.dtype}"
                             + (" (e5m2 x e5m2 is not a pair the fp8 tensor cores run)" if b.dtype in FP8_A else ""))
    if a.shape[1] != b.shape[0]:
        raise InputValueError(f"kernels.scaled_mm: inner dimensions differ: a is {tuple(a.shape)}, b is "
                              f"{tuple(b.shape)}")
    devices = {t.device for t in (a, b, scale_a, scale_b) + (() if bias is None else (bias,))}
    if len(devices) > 1:
        raise InputValueError(f"kernels.scaled_mm: a, b, the scales and the bias must be on one device, got "
                              f"{', '.join(sorted(str(d) for d in devices))}")
    if a.device.type not in ("cuda", "cpu"):
        raise InputValueError(f"kernels.scaled_mm: tensors on {a.device} are not supported (cuda or cpu)")
    m, k, n = a.shape[0], a.shape[1], b.shape[1]
    if a.stride(1) != 1 and k > 1:
        raise InputValueError(f"kernels.scaled_mm: a must be row-major (unit stride along K), got strides "
                              f"{a.stride()} (torch._scaled_mm's rule too)")
    if b.stride(0) != 1 and k > 1:
        raise InputValueError(f"kernels.scaled_mm: b must be column-major (unit stride along K: b = w.t() of a "
                              f"row-major (N, K) w), got strides {b.stride()} (torch._scaled_mm's rule too)")
    if k % SCALED_MULTIPLE or n % SCALED_MULTIPLE:
        raise InputValueError(f"kernels.scaled_mm: K and N must be multiples of {SCALED_MULTIPLE}, got K={k}, N={n} "
                              "(torch._scaled_mm's rule too)")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != torch.float32:
            raise InputTypeError(f"kernels.scaled_mm: {name} must be float32, got {t.dtype}")
        if not t.is_contiguous() or (t.dim() == 2 and t.stride(1) != 1):
            raise InputValueError(f"kernels.scaled_mm: {name} must be contiguous with a unit last stride, got "
                                  f"strides {t.stride()} (torch._scaled_mm's rule too)")
    scaling = scaling_of(a, b, scale_a, scale_b)
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != n:
            raise InputValueError(f"kernels.scaled_mm: bias must have shape ({n},), got {tuple(bias.shape)}")
        if bias.dtype != out_dtype:
            raise InputTypeError(f"kernels.scaled_mm: bias has dtype {bias.dtype}, expected out_dtype {out_dtype}")
    if out is not None:
        check_out("scaled_mm", out, (m, n), out_dtype, a.device,
                  {"a": a, "b": b, "scale_a": scale_a, "scale_b": scale_b, "bias": bias})
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, scale_a, scale_b, bias)):
        raise InputValueError("kernels.scaled_mm is not differentiable (an inference op, as torch._scaled_mm): call "
                              "it under torch.no_grad() or with inputs that do not require grad")
    return scaling


def _check_finite(scale_a, scale_b) -> None:
    """Non-finite scales make every output element NaN/inf: refused on the cold path (one sync per new problem;
    a warm call never looks at a scale's values)."""
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if not bool(torch.isfinite(t).all()):
            raise InputValueError(f"kernels.scaled_mm: {name} has non-finite values")


# -- cold path -------------------------------------------------------------------------------------------------
def problem_of(a, b, scaling: str, bias, out_dtype) -> GemmProblem:
    return GemmProblem.from_tensors("scaled_mm", a, b, bias=bias is not None, scaling=scaling,
                                    out_dtype=DTYPE_NAMES[out_dtype])


def _cold(a, b, scale_a, scale_b, bias, out_dtype, out):
    scaling = validate(a, b, scale_a, scale_b, bias, out_dtype, out)
    _check_finite(scale_a, scale_b)
    if _table is None:
        _load_table()
    operands = (a, b, scale_a, scale_b) + (() if bias is None else (bias,))
    if 0 in (a.shape[0], a.shape[1], b.shape[1]):
        return _trivial(a, b, bias, out_dtype, out)
    problem = problem_of(a, b, scaling, bias, out_dtype)
    copy_bias = bias is not None and bias.stride(0) != 1
    if a.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        with selected.device_context(a):
            launch = selected.resolved(problem) or scaled_mm_launch(problem)
            return (_contiguous_bias(launch) if copy_bias else launch)(*operands, out)
    aten = a.device.type == "cpu" and not interpret_mode()
    if aten:
        launch = scaled_mm_launch(problem)
        _stats.bump("cpu_fallbacks")
    else:
        with selected.device_context(a):
            launch = _record.resolve(problem)
        aten = selected.aten_winner(problem)
    with selected.device_context(a):       # the C++ table's plan is made for the operands' device
        with selected.lock:
            if len(_dispatch) >= config.max_problems:
                clear()                 # rare (thousands of fp8 problems): looked up again, cheaply, from memory
            # this key's calls all have this bias stride (the Python table keys it; the C++ one serves unit strides
            # only)
            python_launch = _contiguous_bias(launch) if copy_bias else launch
            _dispatch[_key(a, b, scale_a, scale_b, bias, out_dtype)] = python_launch
            # aten winners are called by the C++ table itself; other launches through their native launch if they
            # have one (Triton on a GPU), else as they are (CUTLASS, the interpreter)
            fast = (FAST_ATEN_KIND, launch) if aten else (FAST_PYTHON_KIND, getattr(launch, "native", launch))
            key = _fast_key(a, b, scaling, bias, out_dtype)
            _fast_entries[key] = fast
            if _table is not None:
                _table.add(key, *fast)
        return python_launch(*operands, out)


def _contiguous_bias(launch):
    """launch for calls whose bias is not a contiguous vector: the Triton kernels read bias[col] without a stride
    (as for kernels.linear, such a bias is copied; CUTLASS launches copy it themselves, torch._scaled_mm takes it)."""
    def launch_copying_bias(a, b, scale_a, scale_b, bias, out=None):
        return launch(a, b, scale_a, scale_b, bias.contiguous(), out)

    return launch_copying_bias


def _trivial(a, b, bias, out_dtype, out):
    result = torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    if bias is not None:
        result += bias
    return result if out is None else out.copy_(result)


def explain(a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16) -> Selection:
    """The Selection for this fp8 problem (tuning it first if needed)."""
    scaling = validate(a, b, scale_a, scale_b, bias, out_dtype, None)
    problem = problem_of(a, b, scaling, bias, out_dtype)
    if 0 in (problem.m, problem.n, problem.k) or (a.device.type == "cpu" and not interpret_mode()):
        why = ("zero-size dimension: nothing to tune" if 0 in (problem.m, problem.n, problem.k) else
               "CPU tensors: computed with torch._scaled_mm (set TRITON_INTERPRET=1 to run the Triton templates "
               "through the interpreter)")
        return Selection(problem=problem, winner="aten_scaled_mm",
                         choices={"aten_scaled_mm": Choice("aten", "aten_scaled_mm", problem.dtype)}, timings={},
                         source="cpu-fallback" if a.device.type == "cpu" else "trivial", notes=[why])
    sel = selected.selection(problem)
    if sel is not None:
        return dataclasses.replace(sel, source="memory")
    _check_finite(scale_a, scale_b)
    with selected.device_context(a):
        _record.resolve(problem)
    return selected.selection(problem)


def connect(load_table) -> None:
    """api hands in how the C++ table is loaded (on a cold call, as its own cold calls do)."""
    global _load_table
    _load_table = load_table


def table_loaded(module) -> None:
    """The C++ table just loaded: copy this module's entries into it, then route warm calls through it."""
    global _table, _fast_call
    with selected.lock:
        mirror(module)
        _table, _fast_call = module, module.call_scaled_mm


def mirror(module) -> None:
    """Register every entry of this module in the C++ table `module` (after it loaded, or was emptied)."""
    with selected.lock:
        for key, (kind, launch) in _fast_entries.items():
            module.add(key, kind, launch)


def clear() -> None:
    """Forget the warm entries, the C++ table's included."""
    with selected.lock:
        _dispatch.clear()
        if _table is not None:
            for key in _fast_entries:
                _table.discard(key)
        _fast_entries.clear()
