"""`with kernels.enabled():` routes torch's matrix products through kernels for the code inside (a torch function
mode): torch.mm / Tensor.mm, torch.matmul / Tensor.matmul / `@` on 2-D operands and on an N-D activation times a
2-D matrix (flattened to 2-D, as torch.matmul does), F.linear, and torch.addmm / Tensor.addmm with a bias row and
beta = alpha = 1.

Anything the library does not serve goes to torch unchanged and is counted in `kernels.stats()`: "passthroughs"
in total and one "passthrough:<reason>" entry per reason (kernels.core.counters), the reason a short slug:
"dtype=float64", "dtype=int8", "layout=sparse_coo", "device=meta", "subclass=<type>", "type=<type>" (not a
tensor), "dtypes-differ",
"devices-differ", "dims=1-D@2-D" (matmul shapes other than 2-D/N-D @ 2-D), "shape" (sizes that do not
multiply: torch raises its own error), "bias" (a bias that is not (N,) of the inputs' dtype and device), "out"
(out= arguments), "addmm-scale" (beta or alpha not 1), "addmm-input" (an addmm input other than a 1-D bias row),
"refused" (kernels' own validation refused what these checks let through), "batched=bmm" / "batched=baddbmm"
(batched products, which kernels does not serve: counted so that a user sees where such a block's time goes).
Calls torch.compile is tracing are not counted (the compiled graph has no place to count them).

The predicates `mm_unserved` / `linear_unserved` are what kernels.patch asks too.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from kernels.core import counters
from kernels.core.errors import InputTypeError, InputValueError
from kernels.dispatch import api

_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32))
_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_STRIDED = torch.strided
INPUT_ERRORS = (InputTypeError, InputValueError)
_compiling = torch.compiler.is_compiling


def _name(value) -> str:
    return str(value).removeprefix("torch.")


def dense(t) -> bool:
    """A strided tensor of torch's own type (not a subclass): what kernels' own validation takes for granted.
    Everything else kernels checks itself (kernels.mm / kernels.linear raise InputTypeError / InputValueError)."""
    return type(t) in _PLAIN_TYPES and t.layout is _STRIDED


def _tensor_unserved(t) -> str | None:
    if not isinstance(t, torch.Tensor):
        return f"type={type(t).__name__}"
    if type(t) not in _PLAIN_TYPES:
        return f"subclass={type(t).__name__}"
    if t.layout is not torch.strided:
        return f"layout={_name(t.layout)}"
    if t.dtype not in _DTYPES:
        return f"dtype={_name(t.dtype)}"
    if not (t.is_cuda or t.is_cpu):
        return f"device={t.device.type}"
    return None


def _pair_unserved(a, b) -> str | None:
    why = _tensor_unserved(a) or _tensor_unserved(b)
    if why is None and a.dtype is not b.dtype:
        why = "dtypes-differ"
    if why is None and a.device != b.device:
        why = "devices-differ"
    return why


def mm_unserved(a, b) -> str | None:
    """Why kernels.mm would not serve a @ b (a short reason), or None when it does."""
    why = _pair_unserved(a, b)
    if why is None and (a.dim() != 2 or b.dim() != 2):
        why = f"dims={a.dim()}-D@{b.dim()}-D"
    if why is None and a.shape[1] != b.shape[0]:
        why = "shape"
    return why


def linear_unserved(x, weight, bias) -> str | None:
    """Why kernels.linear would not serve F.linear(x, weight, bias), or None when it does."""
    why = _pair_unserved(x, weight)
    if why is None and (x.dim() < 1 or weight.dim() != 2):
        why = f"dims={x.dim()}-D@{weight.dim()}-D"
    if why is None and x.shape[-1] != weight.shape[1]:
        why = "shape"
    if why is None and bias is not None:
        why = _tensor_unserved(bias)
        if why is None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0] or bias.dtype is not x.dtype
                            or bias.device != x.device):
            why = "bias"
    return why


def count_passthrough(reason: str) -> None:
    if not _compiling():
        counters.passthrough(reason)


# -- the routed functions: each takes torch's (args, kwargs) and returns the result, or the reason (a str) to pass
# the call through to torch ------------------------------------------------------------------------------------------
def _arg(args, kwargs, index: int, name: str, default=None):
    return args[index] if len(args) > index else kwargs.get(name, default)


def _mm(args, kwargs):
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "mat2")
    why = "out" if kwargs.get("out") is not None else mm_unserved(a, b)
    return api.mm(a, b) if why is None else why


def _matmul(args, kwargs):
    a, b = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "other")
    if kwargs.get("out") is not None:
        return "out"
    why = _pair_unserved(a, b)
    if why is None and (a.dim() < 2 or b.dim() != 2):
        why = f"dims={a.dim()}-D@{b.dim()}-D"
    if why is None and a.shape[-1] != b.shape[0]:
        why = "shape"
    if why is not None:
        return why
    if a.dim() == 2:
        return api.mm(a, b)
    # (..., M, K) @ (K, N): the leading dims fold into M (a view when a's strides allow, as in torch.matmul)
    out = api.mm(a.flatten(0, -2), b)
    return out.view(*a.shape[:-1], b.shape[1])


def _linear(args, kwargs):
    x, weight, bias = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight"), _arg(args, kwargs, 2, "bias")
    why = linear_unserved(x, weight, bias)
    return api.linear(x, weight, bias) if why is None else why


def _addmm(args, kwargs):
    bias, a, b = (_arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "mat1"), _arg(args, kwargs, 2, "mat2"))
    if kwargs.get("out") is not None:
        return "out"
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        return "addmm-scale"
    why = mm_unserved(a, b)
    if why is None and not (isinstance(bias, torch.Tensor) and bias.dim() == 1):
        why = "addmm-input"
    if why is None:
        why = linear_unserved(a, b.t(), bias)
    # bias + a @ b is linear(a, weight=b.t(), bias): the product's B is b itself, layout and all
    return api.linear(a, b.t(), bias) if why is None else why


def _batched(name: str) -> Callable:
    reason = f"batched={name}"

    def route(args, kwargs):
        return reason
    return route


_ROUTES = {
    torch.mm: _mm, torch.Tensor.mm: _mm,
    torch.matmul: _matmul, torch.Tensor.matmul: _matmul, torch.Tensor.__matmul__: _matmul,
    F.linear: _linear,
    torch.addmm: _addmm, torch.Tensor.addmm: _addmm,
    torch.bmm: _batched("bmm"), torch.Tensor.bmm: _batched("bmm"),
    torch.baddbmm: _batched("baddbmm"), torch.Tensor.baddbmm: _batched("baddbmm"),
}

_active = threading.local()      # how many KernelsMode blocks this thread is inside (an inner one adds nothing)


class KernelsMode(TorchFunctionMode):
    """The torch function mode behind kernels.enabled(). While its handler runs torch pops it, so the torch calls
    kernels itself makes (aten winners are torch.mm) are not routed again."""

    def __call__(self, fn: Callable) -> Callable:
        """`@kernels.enabled()` on a function: each call of it runs routed, as inside a `with` block."""
        @functools.wraps(fn)
        def routed(*args, **kwargs):
            with KernelsMode():
                return fn(*args, **kwargs)
        return routed

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        route = _ROUTES.get(func)
        if route is not None:
            try:
                result = route(args, kwargs)
            except INPUT_ERRORS:          # what the predicates above let through and kernels' validation did not
                result = "refused"
            if not isinstance(result, str):
                return result
            count_passthrough(result)
        return func(*args, **kwargs)

    def __init__(self):
        super().__init__()
        self._pushed: list[bool] = []      # per `with` of this instance: whether it pushed the mode

    def __enter__(self):
        depth = getattr(_active, "depth", 0)
        _active.depth = depth + 1
        self._pushed.append(depth == 0)
        return super().__enter__() if depth == 0 else self

    def __exit__(self, *exc):
        _active.depth -= 1
        return super().__exit__(*exc) if self._pushed.pop() else None


def enabled() -> KernelsMode:
    """`with kernels.enabled():` (or `@kernels.enabled()` on a function) routes torch.mm, torch.matmul (2-D, and
    N-D @ 2-D), F.linear and torch.addmm (beta = alpha = 1, a bias row) through kernels for the code inside; what
    kernels does not serve (batched products among it: bmm, baddbmm) runs in torch unchanged, counted in
    kernels.stats() as "passthroughs" and "passthrough:<reason>". Nested blocks are one."""
    return KernelsMode()
