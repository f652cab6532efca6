"""Kernel handles: one way for template families to launch a kernel, compiled (GPU) or interpreted (CPU).

`handle.bind(grid)` returns `run(*kernel_args)` that launches on the current stream. The compiled path calls
Triton's C launcher directly (about 1 us less per call than CompiledKernel.run) and hands it a scratch buffer kept
per stream, so kernels that build TMA descriptors on the device need no allocation per call.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

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
    """A loaded CompiledKernel on one device."""

    def __init__(self, kernel, device_index: int):
        self.kernel = kernel
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)

    def bind(self, grid: tuple[int, int, int]) -> Run:
        import triton

        kernel, dev = self.kernel, self.device_index
        gx, gy, gz = grid
        knobs = getattr(triton, "knobs", None)
        if knobs is not None and (knobs.runtime.launch_enter_hook or knobs.runtime.launch_exit_hook):
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
            value = made[s] = make()
        return value

    return get


def needs_staging(out: torch.Tensor) -> bool:
    """Kernels write row-major, 16-byte aligned outputs; any other `out` gets a staging buffer and a copy."""
    return (out.stride(1) != 1 and out.shape[1] != 1) or out.data_ptr() % 16 != 0


def output_launch(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, ldc_multiple: int,
                  run_into: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]):
    """launch(a, b, out=None) around `run_into(a, b, out, ldc)`: allocates the output, or writes into the caller's
    `out` directly when the binary's assumptions (row-major, aligned, ldc a multiple of `ldc_multiple`) hold."""
    m, n = shape

    def launch(a, b, out=None):
        if out is None:
            out = torch.empty(m, n, dtype=dtype, device=device)    # sizes as ints: torch parses them faster than a tuple
            run_into(a, b, out, n)
            return out
        if needs_staging(out) or out.stride(0) % ldc_multiple:
            out.copy_(launch(a, b, None))
            return out
        run_into(a, b, out, out.stride(0))
        return out

    return launch
