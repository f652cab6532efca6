"""torch.library custom ops around kernels' plain products: `kernels::mm`, `kernels::int_mm`, `kernels::linear`.

Why: autograd and torch.compile see each product as one operator, with a fake implementation (the result's shape,
dtype and device) and, for mm and linear, a backward whose products (dX = dY·W, dW = dYᵀ·X) are kernels' own
products again, each tuned as its own problem.

Who calls them: kernels.dispatch.api routes `kernels.mm` / `kernels.linear` here when autograd needs the product
(an input requires grad and grad mode is on) or when torch.compile traces the call; a warm call that needs neither
never comes here. The ops' implementations run the plain products api hands over (`Plain`), which never come back
here (no recursion, whatever torch.compiler.is_compiling() says while they run).

When they are registered: on first use, not when `kernels` (or this module) is imported: `CustomOps.ready()`
registers them once per process. The first use may be a call torch.compile is tracing, so `ready` is marked the
way torch.compiler.assume_constant_result marks a function: Dynamo then calls it for real at trace time (it returns
the constant True) instead of tracing the registration, and the op is there when the trace reaches it.
"""
from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.core.problem import ACTIVATIONS, GemmProblem, pointer_alignment

NAMESPACE = "kernels"
SCHEMAS = {
    "mm": "(Tensor a, Tensor b) -> Tensor",
    "int_mm": "(Tensor a, Tensor b) -> Tensor",
    "linear": "(Tensor x, Tensor weight, Tensor? bias, str? activation) -> Tensor",
}

# the derivative of each epilogue activation given the upstream grad and its input z: the aten kernels torch's own
# autograd uses (the same formulas, traceable, so the backward works under torch.compile too)
_ACTIVATION_BACKWARD = {
    "relu": lambda g, z: torch.ops.aten.threshold_backward(g, z, 0),
    "gelu": lambda g, z: torch.ops.aten.gelu_backward(g, z, approximate="tanh"),
    "silu": lambda g, z: torch.ops.aten.silu_backward(g, z),
}
assert set(_ACTIVATION_BACKWARD) == set(ACTIVATIONS), "an epilogue activation without a backward"


# How much more host time kernels' eager autograd Function costs than torch's own autograd per forward + backward of
# one layer (its Python forward and backward around the three products). A layer whose winners save less GPU time
# than that over aten is handed to torch's autograd: in a host-bound step (small M) the Function's cost is the step's,
# while in a GPU-bound one the forgone gain is at most this much per layer. Measured 21-64 us on three H100 hosts
# (`python -m experiments.linear_host_cost --grad --m 16 --k 256 --n 256`, the Function's row less F.linear's,
# twenty-third session): the middle of that.
FUNCTION_HOST_US = 40.0


def kernels_gain_us(selections: list) -> float:
    """GPU time per forward + backward that a layer's winners save over aten, by their tunes' own timings (first-pass
    medians): nothing where aten won or a product has no selection (torch then computes it), without bound where
    aten has no time to compare with (the winner is the only way the tune found)."""
    gain = 0.0
    for sel in selections:
        if sel is None or sel.winner_choice.backend == "aten":
            continue
        aten = [t for name, t in sel.timings.items() if sel.choices.get(name) is not None
                and sel.choices[name].backend == "aten" and isinstance(t, float)]
        winner = sel.timings.get(sel.winner)
        if not aten or not isinstance(winner, float):
            return float("inf")
        gain += max(0.0, min(aten) - winner) * 1000.0
    return gain


@dataclass(frozen=True)
class Plain:
    """The products the ops run: kernels.dispatch.api's warm table / cold path, never routed back to the ops."""
    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    int_mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str | None], torch.Tensor]
    # look a problem up ahead of its call on the device of an operand of it (tune or load it; never raises): what
    # BackwardAhead hands its problems to
    prepare: Callable[[GemmProblem, torch.Tensor], None] = lambda problem, like: None
    max_problems: Callable[[], int] = lambda: 4096      # how many layers BackwardAhead remembers (KERNELS_MAX_PROBLEMS)
    # called once, right after the ops are defined: api binds the C++ table's dispatcher kernels then (bind_native)
    defined: Callable[[], None] = lambda: None


_registered: list[Plain] = []      # the products the ops were registered around: one registration per process
_ready: list[bool] = []            # set once the ops are registered and, where the C++ table is loaded, bound to it
_lock = threading.RLock()          # re-entered: ready() binds (bind_native) while holding it


class CustomOps:
    """The routed calls of kernels.dispatch.api: each makes sure the ops exist, then calls one (eager or traced)."""

    def __init__(self, plain: Plain):
        self.plain = plain
        self.ready = _registrar(plain)
        self.ahead = BackwardAhead(plain.prepare, plain.max_problems)
        self._eager_mm, self._eager_linear = _eager_functions(plain, self.ahead, self.ready)

    def eager_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """mm for an untraced call that needs grad (see _eager_functions)."""
        return self._eager_mm.apply(a, b)

    def eager_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     activation: str | None) -> torch.Tensor:
        return self._eager_linear.apply(x, weight, bias, activation)

    def mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.ready()
        return torch.ops.kernels.mm(a, b)

    def int_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.ready()
        return torch.ops.kernels.int_mm(a, b)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None) -> torch.Tensor:
        """With an activation and autograd on, the caller should not come here fused: it calls this with
        activation=None and applies the activation with torch ops, so autograd differentiates the activation from
        its own saved input. Fusion is for inference. (Called fused under autograd anyway, the backward recomputes
        the pre-activation product: correct, one product more.)"""
        self.ready()
        return torch.ops.kernels.linear(x, weight, bias, activation)


def _registrar(plain: Plain) -> Callable[[], bool]:
    def ready() -> bool:
        if not _ready:
            with _lock:
                if not _ready:
                    if not _registered:
                        _define(plain)
                        _registered.append(plain)
                    plain.defined()      # bound before any thread is told the ops are ready
                    _ready.append(True)
        return True

    # what torch.compiler.assume_constant_result(ready) sets; calling that here would import torch._dynamo (~1 s)
    # into every process that uses kernels, compiled or not
    ready._dynamo_marked_constant = True
    return ready


def _define(plain: Plain) -> None:
    """Register the three ops with torch.library: implementation, fake implementation, autograd."""
    mm = torch.library.custom_op(f"{NAMESPACE}::mm", mutates_args=(), schema=SCHEMAS["mm"])(
        lambda a, b: plain.mm(a, b))
    mm.register_fake(lambda a, b: a.new_empty((a.shape[0], b.shape[1])))
    mm.register_autograd(_mm_backward, setup_context=_save_inputs)

    int_mm = torch.library.custom_op(f"{NAMESPACE}::int_mm", mutates_args=(), schema=SCHEMAS["int_mm"])(
        lambda a, b: plain.int_mm(a, b))
    int_mm.register_fake(lambda a, b: a.new_empty((a.shape[0], b.shape[1]), dtype=torch.int32))

    linear = torch.library.custom_op(f"{NAMESPACE}::linear", mutates_args=(), schema=SCHEMAS["linear"])(
        lambda x, weight, bias, activation: plain.linear(x, weight, bias, activation))
    linear.register_fake(lambda x, weight, bias, activation: x.new_empty((*x.shape[:-1], weight.shape[0])))
    linear.register_autograd(_linear_backward, setup_context=_save_linear)


_native: list = []       # the C++ table module whose dispatcher kernels serve the ops


def bind_native(module) -> bool:
    """Once the ops are defined, have the C++ table's dispatcher kernels serve them (kernels/native/csrc/fastpath.cpp,
    register_ops), calling back per op into the product the ops were registered around on a table miss, and into
    the op's differentiable forward for a call autograd records (int_mm: none, not differentiable). A process loads
    one library; where another copy is loaded later (the tests load one per cache directory), the latest takes over
    (its table is the one api fills). True when this call bound them; a failure warns and leaves the Python kernels.

    When the table loads in the background after the ops were defined, the kernels are registered while other threads
    may be calling the ops: torch's dispatcher, like any late torch.library registration, does not lock its readers."""
    if module is None or not _registered:
        return False
    with _lock:
        if _native and _native[0] is module:
            return False
        plain = _registered[0]
        # called from C++ on eager calls: never a frame for Dynamo to trace (as torch.library wraps its own)
        products = {name: torch._disable_dynamo(fn) for name, fn in
                    (("mm", plain.mm), ("int_mm", plain.int_mm), ("linear", plain.linear))}
        grads = {"mm": torch._disable_dynamo(_traced_mm), "int_mm": None,
                 "linear": torch._disable_dynamo(_traced_linear)}
        try:
            with warnings.catch_warnings():
                if _native:     # a later copy overriding the earlier one's kernels is the point; the dispatcher warns
                    warnings.filterwarnings("ignore", r"(?s).*Overriding a previously registered kernel")
                bound = module.register_ops(products, grads)
        except Exception as e:  # noqa: BLE001 - the Python kernels go on serving the ops
            warnings.warn(f"kernels: the C++ dispatcher kernels for the custom ops could not be registered "
                          f"({type(e).__name__}: {e}); torch.library's Python ones serve them", RuntimeWarning,
                          stacklevel=2)
            return False
        if bound:
            _native[:] = [module]
    return bool(bound)


def _save_inputs(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _save_linear(ctx, inputs, output) -> None:
    x, weight, bias, activation = inputs
    ctx.save_for_backward(x, weight, bias)
    ctx.activation = activation


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """t (..., K) as (rows, K): a view where its strides allow, else a copy. The rows are spelled out, not -1, so a
    K of 0 flattens too."""
    return t if t.dim() == 2 else t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _dense(grad: torch.Tensor) -> torch.Tensor:
    # a broadcast grad (stride 0: the backward of sum() or mean()) is materialized: a product over a broadcast is
    # not a layout worth a tune of its own
    return grad.contiguous() if 0 in grad.stride() else grad


def _op_mm(a, b):
    return torch.ops.kernels.mm(a, b)


def _op_linear(x, weight, bias, activation):
    return torch.ops.kernels.linear(x, weight, bias, activation)


def _mm_grads(ctx, grad, mm):
    """dA = dY·Bᵀ, dB = Aᵀ·dY through `mm` (kernels' tuned products)."""
    a, b = ctx.saved_tensors
    grad = _dense(grad)
    grad_a = mm(grad, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = mm(a.t(), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


def _linear_grads(ctx, grad, mm, linear):
    """y = act(x·Wᵀ + b): dZ = act'(z)·dY (z recomputed only when the forward ran fused), dX = dZ·W, dW = dZᵀ·X,
    db = dZ summed over rows (in fp32, then cast to the bias dtype)."""
    x, weight, bias = ctx.saved_tensors
    grad = _dense(grad)
    if ctx.activation:
        z = linear(x, weight, bias, None)
        grad = _ACTIVATION_BACKWARD[ctx.activation](grad, z)
    grad2 = as_2d(grad)
    grad_x = grad_w = grad_bias = None
    if ctx.needs_input_grad[0]:
        grad_x = mm(grad2, weight).reshape(x.shape)
    if ctx.needs_input_grad[1]:
        grad_w = mm(grad2.t(), as_2d(x))
    if bias is not None and ctx.needs_input_grad[2]:
        grad_bias = grad2.sum(0, dtype=torch.float32).to(bias.dtype)
    return grad_x, grad_w, grad_bias, None


def _mm_backward(ctx, grad):
    """The registered autograd: through kernels::mm, so traceable (AOTAutograd) and differentiable again."""
    return _mm_grads(ctx, grad, _op_mm)


def _linear_backward(ctx, grad):
    return _linear_grads(ctx, grad, _op_mm, _op_linear)


def _traced_function(class_name: str, op, save, backward) -> type:
    """The op call `op` (_op_mm, _op_linear) with the autograd registered for it (`save` as setup_context,
    `backward`) as an autograd.Function: what the C++ dispatcher kernel at Autograd<device> hands a call autograd
    records, so autograd, AOTAutograd's joint trace and a double backward see the same forward and backward as through
    the Python registration. Its forward runs with grad mode off, so the op inside goes below autograd."""
    return type(class_name, (torch.autograd.Function,), {
        "forward": staticmethod(op), "setup_context": staticmethod(save), "backward": staticmethod(backward)})


_TracedMm = _traced_function("_TracedMm", _op_mm, _save_inputs, _mm_backward)
_TracedLinear = _traced_function("_TracedLinear", _op_linear, _save_linear, _linear_backward)


def _traced_mm(a, b):
    return _TracedMm.apply(a, b)


def _traced_linear(x, weight, bias, activation):
    return _TracedLinear.apply(x, weight, bias, activation)


class BackwardAhead:
    """Meets each backward product at its layer's first forward with grad: the problems the backward will ask for
    (dX = dY·W, dW = dYᵀ·X for linear; dA, dB for mm, with dY dense as _dense leaves it) are looked up (tuned, or
    loaded) then, without running anything. Why: a tune inside the backward runs while DDP's gradient all-reduces are
    in flight; the peer rank waits for this one, its NCCL kernels spin on this GPU, and the tune times its candidates
    on fewer SMs than the training step will. A backward whose operands arrive otherwise laid out looks its own
    problem up then, as before. Costs a set lookup per eager forward with grad (keyed by the weight and the input's
    shape)."""

    def __init__(self, prepare: Callable[[GemmProblem, torch.Tensor], None], limit: Callable[[], int]):
        self.prepare, self.limit = prepare, limit
        self.seen: set[tuple] = set()
        self.lock = threading.Lock()

    def forget(self) -> None:
        """Meet every layer again (kernels.clear_memory_cache: the selections behind the products are gone)."""
        with self.lock:
            self.seen.clear()

    def _first(self, key: tuple) -> bool:
        with self.lock:
            if key in self.seen:
                return False
            if len(self.seen) >= self.limit():
                self.seen.clear()
            self.seen.add(key)
            return True

    def linear(self, x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...]) -> None:
        if (needs[0] or needs[1]) and self._first((*_facts(weight), x.shape, x.stride(), needs[0], needs[1])):
            for problem in linear_backward_problems(x, weight, needs):
                self.prepare(problem, x)

    def mm(self, a: torch.Tensor, b: torch.Tensor, needs: tuple[bool, ...]) -> None:
        if (needs[0] or needs[1]) and self._first((*_facts(b), *_facts(a), needs[0], needs[1])):
            for problem in mm_backward_problems(a, b, needs):
                self.prepare(problem, a)


def _facts(t: torch.Tensor) -> tuple:
    # what a backward problem is made of, not the tensor's identity: under autocast each call's operand is a fresh
    # cast (a new id every step), which re-ran the look-ahead on every forward
    return t.dtype, t.device, t.shape, t.stride()


def linear_backward_problems(x: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, ...]) -> list[GemmProblem]:
    """The products kernels.linear's backward will ask for (dX = dY·W, dW = dYᵀ·X, with dY dense as _dense leaves it
    and X as the backward's as_2d(x) gives it), for the grads `needs` names (x's, weight's)."""
    m, (n, k) = math.prod(x.shape[:-1]), weight.shape
    try:                                   # X as the backward's as_2d(x) gives it: a view...
        x2_stride, x2_align = tuple(x.view(m, k).stride()), _alignment(x)
    except RuntimeError:                   # ...or a fresh contiguous copy
        x2_stride, x2_align = (k, 1), 16
    problems = []
    if needs[0]:                           # dY: (m, n), dense and fresh
        problems.append(_problem(x, (m, k, n), (n, 1), tuple(weight.stride()), 16, _alignment(weight)))
    if needs[1]:
        problems.append(_problem(x, (n, k, m), (1, n), x2_stride, 16, x2_align))
    return problems


def mm_backward_problems(a: torch.Tensor, b: torch.Tensor, needs: tuple[bool, ...]) -> list[GemmProblem]:
    """The products kernels.mm's backward will ask for (dA = dY·Bᵀ, dB = Aᵀ·dY), for the grads `needs` names."""
    (m, k), n = a.shape, b.shape[1]
    problems = []
    if needs[0]:
        problems.append(_problem(a, (m, k, n), (n, 1), (b.stride(1), b.stride(0)), 16, _alignment(b)))
    if needs[1]:
        problems.append(_problem(a, (k, n, m), (a.stride(1), a.stride(0)), (n, 1), _alignment(a), 16))
    return problems


def _problem(like: torch.Tensor, mnk, stride_a, stride_b, align_a: int, align_b: int) -> GemmProblem:
    return GemmProblem.from_layout("mm", like.dtype, like.device, mnk, stride_a, stride_b, align_a, align_b)


def _alignment(t: torch.Tensor) -> int:
    return pointer_alignment(t.data_ptr())


def _eager_functions(plain: Plain, ahead: BackwardAhead, ready: Callable[[], bool]) -> tuple[type, type]:
    """autograd.Functions for eager (untraced) calls that need grad: the same forward and backward as the ops' own
    autograd, on the plain products, without the custom-op dispatch around each call (its Python layers cost ~50 us
    per call on a CPU host where torch's F.linear costs 4: the gap a host-bound training step pays per layer). A
    backward under create_graph (grad mode on) runs through the ops, so it is differentiable again (gradient
    penalties, double backward); torch.compile traces the ops instead."""

    class EagerMm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            ahead.mm(a, b, ctx.needs_input_grad)
            return plain.mm(a, b)

        @staticmethod
        def backward(ctx, grad):
            if torch.is_grad_enabled() and ready():      # create_graph: through the ops, whose autograd is registered
                return _mm_grads(ctx, grad, _op_mm)
            return _mm_grads(ctx, grad, plain.mm)

    class EagerLinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, activation):
            ctx.save_for_backward(x, weight, bias)
            ctx.activation = activation
            ahead.linear(x, weight, ctx.needs_input_grad)
            return plain.linear(x, weight, bias, activation)

        @staticmethod
        def backward(ctx, grad):
            if torch.is_grad_enabled() and ready():
                return _linear_grads(ctx, grad, _op_mm, _op_linear)
            return _linear_grads(ctx, grad, plain.mm, plain.linear)

    return EagerMm, EagerLinear
