"""Kernel handles: one way for template families to launch a kernel, compiled (GPU) or interpreted (CPU).

`handle.bind(grid)` returns `run(*kernel_args)` that launches on the current stream. The compiled path calls
Triton's C launcher directly (about 1 us less per call than CompiledKernel.run) and hands it a scratch buffer kept
per stream, so kernels that build TMA descriptors on the device need no allocation per call.

`attach_native(launch, ...)`: the same launches described as data (KernelCall), handed to the C++ warm-call table
(kernels/csrc/fastpath.cpp), which then runs the whole call (output allocation and every launch) without Python.
"""
from __future__ import annotations

import enum
import inspect
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from kernels.native import fastpath

Run = Callable[..., None]


class InterpretedHandle:
    """A @triton.jit function run by the interpreter on CPU tensors."""

    def __init__(self, fn):
        self.fn = fn
        self.device = torch.device("cpu")

    def bind(self, grid: tuple[int, int, int]) -> Run:
        launcher = self.fn[grid]

        def run(*args):
            launcher(*args)

        return run


class CompiledHandle:
    """A loaded CompiledKernel on one device; `arg_types` are its signature's types ("*bf16", "i32", ...)."""

    def __init__(self, kernel, device_index: int, arg_types: tuple[str, ...] = ()):
        self.kernel = kernel
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self.arg_types = tuple(arg_types)

    def native_layout(self) -> tuple[tuple[int, int, int, int], str]:
        """((function, threads per block, dynamic shared bytes, global scratch bytes per program), '') when the C++
        table can launch this kernel itself, else (None, why not). Only the launcher layout of triton 3.5-3.6 is known
        (kernel parameters: the signature's arguments, then global and profile scratch pointers)."""
        import triton

        if launch_hooks_installed():
            return None, "a Triton launch hook is installed (a profiler must see every launch)"
        direct = _direct_launch(self.kernel)
        if direct is None:
            return None, f"unknown launcher layout (triton {triton.__version__})"
        _, cooperative, pdl, scratch = direct
        if cooperative or pdl:
            return None, "cooperative or PDL launch"
        meta = self.kernel.metadata
        num_warps, shared = int(meta.num_warps), int(meta.shared)
        packed = getattr(self.kernel, "packed_metadata", None)
        if isinstance(packed, tuple) and len(packed) >= 3 and (packed[0] != num_warps or packed[2] != shared):
            return None, "kernel metadata and launcher metadata disagree"
        if int(getattr(meta, "num_ctas", 1)) != 1:
            return None, "clusters (num_ctas > 1)"
        if not self.arg_types:
            return None, "argument types unknown"
        return (int(self.kernel.function), 32 * num_warps, shared, int(scratch)), ""

    def bind(self, grid: tuple[int, int, int]) -> Run:
        run = self._bind(grid)
        current = getattr(torch._C, "_cuda_getDevice", None)
        if current is None or torch.cuda.device_count() == 1:
            return run                          # one device: always the current one, no check per launch
        dev = self.device_index

        def run_on_its_device(*args):
            # a launch goes to the current device's context: called with another device current (operands on
            # cuda:1 while cuda:0 is current), the kernel's device is made current around it
            if current() == dev:
                run(*args)
            else:
                with torch.cuda.device(dev):
                    run(*args)

        return run_on_its_device

    def grid_launcher(self):
        """launch(grid_x, *args) on the current stream through Triton's C launcher, the grid given per call (a
        kernel whose programs follow the call's rows), or None where Triton's own path must launch it: a launch hook
        is installed, the kernel needs global scratch, or this Triton's launcher layout is not one we know."""
        direct = None if launch_hooks_installed() else _direct_launch(self.kernel)
        if direct is None or direct[3]:
            return None
        c_launch, coop, pdl, _ = direct
        function, packed = self.kernel.function, self.kernel.packed_metadata
        raw_stream, dev = torch._C._cuda_getCurrentRawStream, self.device_index

        def launch(grid_x: int, *args) -> None:
            c_launch(grid_x, 1, 1, raw_stream(dev), function, coop, pdl, None, None, packed, None, None, None, *args)

        return launch

    def _bind(self, grid: tuple[int, int, int]) -> Run:
        kernel, dev = self.kernel, self.device_index
        gx, gy, gz = grid
        if launch_hooks_installed():
            # a profiler hook is installed: take Triton's own (slower) path so it sees the launch
            _ensure_allocator()

            def run_hooked(*args):
                kernel[grid](*args)

            return run_hooked
        raw_stream = torch._C._cuda_getCurrentRawStream
        function, packed = kernel.function, kernel.packed_metadata
        direct = _direct_launch(kernel)
        if direct is None:
            _ensure_allocator()
            slow = kernel.run

            def run_slow(*args):
                slow(gx, gy, gz, raw_stream(dev), function, packed, None, None, None, *args)

            return run_slow
        c_launch, coop, pdl, scratch_per_program = direct
        if not scratch_per_program:
            def run(*args):
                c_launch(gx, gy, gz, raw_stream(dev), function, coop, pdl, None, None, packed, None, None, None,
                         *args)

            return run
        # device-side descriptors live in global scratch: one buffer per stream, so concurrent launches on
        # different streams never share it
        nbytes = gx * gy * gz * scratch_per_program
        buffers: dict[int, torch.Tensor] = {}

        def run_scratch(*args):
            stream = raw_stream(dev)
            buf = buffers.get(stream)
            if buf is None:
                buf = buffers[stream] = torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dev))
            c_launch(gx, gy, gz, stream, function, coop, pdl, buf, None, packed, None, None, None, *args)

        return run_scratch


def launch_hooks_installed() -> bool:
    """Whether a profiler or user put a launch hook in Triton's knobs. Since triton 3.5 the knobs hold a HookChain
    object even when nothing is hooked (always truthy), so its `calls` are what count."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return False
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and (len(hook.calls) > 0 if hasattr(hook, "calls") else True):
            return True
    return False


def _direct_launch(kernel):
    """(C launch function, cooperative, pdl, scratch bytes per program) for the launcher layout we know (triton
    3.5-3.6: launch(gx, gy, gz, stream, function, cooperative, pdl, global_scratch, profile_scratch, *rest)).
    None means: use kernel.run."""
    launcher = kernel.run
    mod_launch = getattr(launcher, "launch", None)
    try:
        params = list(inspect.signature(type(launcher).__call__).parameters)
    except (TypeError, ValueError):
        return None
    if mod_launch is None or params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]:
        return None
    if getattr(launcher, "profile_scratch_size", 1) or getattr(launcher, "num_ctas", 1) != 1:
        return None
    scratch = getattr(launcher, "global_scratch_size", None)
    if scratch is None:
        return None
    return mod_launch, launcher.launch_cooperative_grid, launcher.launch_pdl, int(scratch)


_allocator_set = [False]


def _ensure_allocator() -> None:
    """Triton's own launch path asks its allocator for descriptor scratch; give it torch's caching allocator."""
    if _allocator_set[0]:
        return
    import triton

    set_allocator = getattr(triton, "set_allocator", None)
    if set_allocator is not None:
        set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    _allocator_set[0] = True


def stream_getter(device: torch.device) -> Callable[[], int]:
    """() -> the current stream's handle on `device` (0 on CPU): the key for per-stream workspaces."""
    if device.type != "cuda":
        return lambda: 0
    raw, index = torch._C._cuda_getCurrentRawStream, device.index
    return lambda: raw(index)


def per_stream(device: torch.device, make: Callable[[], object]) -> Callable[[], object]:
    """() -> make()'s result for the current stream, made on first use there: workspaces that concurrent launches
    on two streams must not share, allocated once rather than per call."""
    stream = stream_getter(device)
    made: dict[int, object] = {}

    def get():
        s = stream()
        value = made.get(s)
        if value is None:
            value = made[s] = outside_graph_pools(device, make)
        return value

    return get


def outside_graph_pools(device: torch.device, make: Callable[[], object]) -> object:
    """make() for the current stream, its tensors outside any CUDA-graph memory pool. Why: torch.compile's CUDA-graph
    trees warm a graph up with every allocation of the warming thread routed to the graph's private pool, then refuse
    the pool if it holds tensors the graph's outputs do not account for, as a workspace kept for later calls would
    ("Detected N tensor(s) in the cudagraph pool not tracked as outputs"). That routing is per thread, so a helper
    thread makes them, on this thread's current stream: their kernels (a zero fill) stay in stream order with the
    launches that use them. Inside a capture, allocations on the capturing stream belong to the graph whichever thread
    makes them: make() here, the workspace kept with the graph, as a plain torch.cuda.graph capture expects."""
    if device.type != "cuda":
        return make()
    with torch.cuda.device(device):
        if torch.cuda.is_current_stream_capturing():
            return make()
    stream = torch.cuda.current_stream(device)
    made: list = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                made.append(make())
        except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
            failed.append(e)

    helper = threading.Thread(target=run, name="kernels-workspace", daemon=True)
    helper.start()
    helper.join()
    if failed:
        raise failed[0]
    return made[0]


def needs_staging(out: torch.Tensor) -> bool:
    """Kernels write row-major, 16-byte aligned outputs; any other `out` gets a staging buffer and a copy."""
    return (out.stride(1) != 1 and out.shape[1] != 1) or out.data_ptr() % 16 != 0


def output_launch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, ldc_multiple: int,
                  run_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, tuple], None],
                  epilogue: int = 0):
    """launch(a, b, out=None), or launch(a, b, *epi, out=None) when the problem's epilogue takes `epilogue` tensors
    (its bias; scaled_mm's two scales, then the bias), around `run_into(a, b, out, ldc, epi)`: allocates the
    output, or writes into the caller's `out` directly when the binary's assumptions (row-major, aligned, ldc a
    multiple of `ldc_multiple`) hold."""
    m, n = shape

    def launch(a, b, out=None, _epi=()):
        if out is None:
            out = torch.empty(m, n, dtype=dtype, device=device)    # sizes as ints: torch parses them faster than a tuple
            run_into(a, b, out, n, _epi)
            return out
        if needs_staging(out) or out.stride(0) % ldc_multiple:
            out.copy_(launch(a, b, None, _epi))
            return out
        run_into(a, b, out, out.stride(0), _epi)
        return out

    if epilogue == 0:
        return launch
    if epilogue == 1:
        def launch_with_bias(a, b, bias, out=None):
            return launch(a, b, out, (bias,))

        return launch_with_bias

    def launch_with_epilogue(a, b, *rest):
        if len(rest) not in (epilogue, epilogue + 1):
            raise TypeError(f"launch takes a, b, {epilogue} epilogue tensors and an optional out, got "
                            f"{2 + len(rest)} arguments")
        return launch(a, b, rest[epilogue] if len(rest) > epilogue else None, rest[:epilogue])

    return launch_with_epilogue


class Operand(enum.IntEnum):
    """Kernel arguments that change from call to call: the operands' and the output's pointers (the C++ table's
    `Operand` enum)."""
    A = 0
    B = 1
    OUT = 2
    BIAS = 3        # the epilogue's (N,) vector, for problems with a bias
    SCALE_A = 4     # scaled_mm's fp32 scales: one element each, or (M, 1) and (1, N)
    SCALE_B = 5


def epilogue_operands(scaling: str, bias: bool) -> tuple[Operand, ...]:
    """The epilogue tensors a launch takes, as Operands in the order launches take them: scaled_mm's scales, then
    the bias."""
    return ((Operand.SCALE_A, Operand.SCALE_B) if scaling else ()) + ((Operand.BIAS,) if bias else ())


@dataclass(frozen=True)
class KernelCall:
    """One launch of a choice as data: handle, grid, and the arguments in signature order, each an Operand, a tensor
    the launcher owns (workspace or copy buffer, for the current stream), or an int."""
    handle: object
    grid: tuple[int, int, int]
    args: tuple


_I32 = (-(1 << 31), (1 << 31) - 1)


def _encode(call: KernelCall, layout) -> tuple[tuple, list]:
    """The C++ step tuple for one launch, and what it must keep alive (scratch)."""
    function, threads, shared, scratch_per_program = layout
    types = call.handle.arg_types
    if len(types) != len(call.args):
        raise ValueError(f"{len(call.args)} arguments for a kernel taking {len(types)}")
    values, operands, owned = [], [], []
    for i, (arg, ty) in enumerate(zip(call.args, types)):
        pointer = ty.startswith("*")
        if isinstance(arg, Operand) and pointer:
            values.append(0)
            operands.append((i, int(arg)))
        elif isinstance(arg, torch.Tensor) and pointer:
            values.append(arg.data_ptr())
        elif isinstance(arg, int) and not isinstance(arg, bool) and ty in ("i32", "i64") and not pointer:
            if ty == "i32" and not _I32[0] <= arg <= _I32[1]:
                raise ValueError(f"argument {i} = {arg} does not fit i32")
            values.append(arg)
        else:
            raise ValueError(f"argument {i} ({type(arg).__name__}) does not match its type {ty}")
    scratch = 0
    if scratch_per_program:
        gx, gy, gz = call.grid
        buf = torch.empty(gx * gy * gz * scratch_per_program, dtype=torch.uint8, device=call.handle.device)
        owned.append(buf)
        scratch = buf.data_ptr()
    values += [scratch, 0]              # the hidden global- and profile-scratch parameters
    return (function, *call.grid, threads, shared, values, operands), owned


def native_launch(module, launch, shape: tuple[int, int], out_dtype: torch.dtype, calls: list[KernelCall],
                  scaling: str = ""):
    """A NativeLaunch of the loaded C++ table `module` running `calls` for the current stream (falling back to
    `launch` elsewhere), or (None, why not): every handle must be compiled, with a launcher layout we know.
    `scaling` ("", "tensor" or "row"): how many elements the calls' scales have (one, or M and N), which the C++
    side checks on every call."""
    if not calls or not all(isinstance(c.handle, CompiledHandle) for c in calls):
        return None, "not a compiled kernel"
    device = calls[0].handle.device_index
    steps, owned = [], []
    for call in calls:
        layout, why = call.handle.native_layout()
        if layout is None:
            return None, why
        try:
            step, keep = _encode(call, layout)
        except ValueError as e:
            return None, f"arguments not expressible natively: {e}"
        steps.append(step)
        owned += keep
    # the fixed tensors (workspaces) are kept alive by the native object, with the scratch made here
    owned += [arg for call in calls for arg in call.args if isinstance(arg, torch.Tensor)]
    stream = torch._C._cuda_getCurrentRawStream(device)
    m, n = shape
    return module.native(device, stream, m, n, out_dtype, steps, launch, tuple(owned), scaling), ""


def attach_native(launch, shape: tuple[int, int], out_dtype: torch.dtype, calls: Callable[[], list[KernelCall]],
                  scaling: str = ""):
    """Give `launch` a NativeLaunch as `.native` and `.direct` when one can be made (the dispatch table and the
    tuner's timing call `.direct(a, b[, epilogue tensors])`; verification calls `.native(..., out)`); `.native_why`
    says why not. `calls()` describes the launches for the current stream; it is only called when the table is
    loaded."""

    module = fastpath.loaded_module()
    if module is None:
        launch.native_why = "the C++ warm-call table is not loaded"
        return launch
    native, why = native_launch(module, launch, shape, out_dtype, calls(), scaling)
    if native is not None:
        launch.direct = launch.native = native
    launch.native_why = why
    return launch


def kernel_sequence(handles: list, grids: list[tuple[int, int, int]], args, shape: tuple[int, int],
                    out_dtype: torch.dtype, ldc_multiple: int, buffers: Callable[[], object] = lambda: None,
                    bias: bool = False, scaling: str = ""):
    """launch(a, b, out=None) (launch(a, b, *epi, out=None) when the problem has an epilogue: scaled_mm's scales for
    its `scaling`, then the bias) for a choice that launches its kernels in order, with a native launch attached
    where the C++ table can run it (a, b, out, the bias and the scales). `args(a, b, out, ldc, bufs, epi)` gives one
    argument tuple per kernel, `epi` being the epilogue's tensors for the kernels that take them;
    `buffers()` the current stream's workspaces (per_stream), handed to `args` as `bufs`. The Python path and the
    native description both come from `args`, so they cannot disagree."""
    runs = [h.bind(g) for h, g in zip(handles, grids)]

    def run_into(a, b, out, ldc, epi):
        for run, kernel_args in zip(runs, args(a, b, out, ldc, buffers(), epi)):
            run(*kernel_args)

    epi = epilogue_operands(scaling, bias)

    def calls():
        described = args(Operand.A, Operand.B, Operand.OUT, shape[1], buffers(), epi)
        return [KernelCall(h, g, x) for h, g, x in zip(handles, grids, described)]

    launch = output_launch(shape, out_dtype, handles[0].device, ldc_multiple, run_into, len(epi))
    return attach_native(launch, shape, out_dtype, calls, scaling)
