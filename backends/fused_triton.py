"""The fused blocks' kernels (templates/triton/rmsnorm.py.jinja, swiglu.py.jinja): rendered once per process,
published under the Triton backend's source folder by content hash and loaded from their checked bytes, as the GEMM
families' modules are (backends.triton_modules). No tuning: one configuration per row width.

How they launch. On a GPU, a binary per specialisation (the arguments' dtypes, which pointers are 16-byte aligned,
the row widths and strides) is compiled on its first call (triton.compile, into Triton's own cache, as its JIT
would) and launched through Triton's C launcher with the call's grid: a llama layer runs these blocks at every
step, and the JIT's launch path costs more host time than the several small kernels of eager's ops it replaces
when the step is bound by the host. A binary assumes only what its key holds (`specialisation_key`): the integers that
change from call to call (rows, element counts) are never specialised on. Under the Triton interpreter (CPU), with a
launch hook installed (a profiler), or with a launcher layout this Triton does not have, Triton's JIT launches them.

The functions take and return torch tensors; they check nothing the caller (kernels.dispatch.fused) has not:
2-D rows with a unit column stride for RMSNorm, contiguous tensors of one shape for SwiGLU.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from backends.triton_launch import CompiledHandle, launch_hooks_installed
from backends.triton_modules import module_file_name
from backends.triton_modules import publish as publish_module
from backends.triton_render import render_file
from backends.triton_worker import load_kernel
from kernels.core.cache_root import cache_root
from kernels.core.fsutil import atomic_write_text
from kernels.space.heuristics import cdiv, next_pow2

FUSED_TEMPLATES = {"rmsnorm": "rmsnorm.py.jinja", "swiglu": "swiglu.py.jinja"}    # under templates/triton
MAX_ROW = 16384            # RMSNorm keeps one row in registers: wider rows are not served (run on the GPU to 11008)
_ELEMENTWISE_BLOCK = 1024
_I32_MAX = (1 << 31) - 1
_TRITON_TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


class FusedKernels:
    """One block's forward and backward kernels."""

    def __init__(self, block: str):
        name = f"kernels_fused_{block}"
        source = render_file(FUSED_TEMPLATES[block], name)
        path = cache_root() / "triton" / "src" / module_file_name(block, source)
        publish_module(path, source, atomic_write_text)
        self.forward = load_kernel(str(path), name + "_forward")
        self.backward = load_kernel(str(path), name + "_backward")


@functools.lru_cache(maxsize=None)
def kernels_of(block: str) -> FusedKernels:
    return FusedKernels(block)


@functools.lru_cache(maxsize=None)
def _programs(device: torch.device) -> int:
    """Programs of a row-blocked backward: a few per SM on a GPU, a few on CPU (the interpreter runs them serially)."""
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def _on_device_of(t: torch.Tensor):
    """Triton launches on the current device's stream: a tensor on another GPU makes its device current around the
    launch (a model split over GPUs calls blocks on each)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _row_launch(width: int) -> tuple[int, int]:
    block = next_pow2(width)
    return block, 16 if block >= 8192 else 8 if block >= 2048 else 4


@dataclass(frozen=True)
class FusedKernel:
    """One of the fused kernels as its launches see it. A binary is specialised on the integer arguments at `keyed`
    (each call's key holds their values: widths, strides) and on whether those at `divisible` are multiples of 16
    (element counts: an elementwise kernel's masked loads vectorise only then); it assumes nothing of the others
    (rows)."""
    block: str           # "rmsnorm" | "swiglu"
    which: str           # "forward" | "backward"
    keyed: tuple[int, ...] = ()
    divisible: tuple[int, ...] = ()


# the row width N is keyed (BLOCK follows it); row strides only as multiples of 16 or not: any stride a caller's
# view has must not make a binary of its own (the cache would grow with each, and a new one under a CUDA-graph
# capture would load a module there)
RMSNORM_FORWARD = FusedKernel("rmsnorm", "forward", keyed=(6,), divisible=(4, 5))
RMSNORM_BACKWARD = FusedKernel("rmsnorm", "backward", keyed=(10,), divisible=(6, 7, 8))
SWIGLU_FORWARD = FusedKernel("swiglu", "forward", divisible=(3,))            # numel
SWIGLU_BACKWARD = FusedKernel("swiglu", "backward", divisible=(5,))

_MISSING = object()
_compiled: dict[tuple, object] = {}     # (kernel, device, block, warps, key) -> launch(grid_x, *args), or None


def specialisation_key(args: tuple, kernel: FusedKernel) -> tuple:
    """What a binary for these arguments assumes: each tensor's dtype and 16-byte alignment, the keyed integers'
    values, whether the divisible ones are multiples of 16. Two calls with one key get one binary."""
    return (tuple((a.dtype, not a.data_ptr() & 15) for a in args if isinstance(a, torch.Tensor))
            + tuple(args[i] for i in kernel.keyed) + tuple(not args[i] & 15 for i in kernel.divisible))


def signature(args: tuple, kernel: FusedKernel) -> tuple[dict[str, str], list[int]]:
    """The Triton signature of a binary for `args` (the kernel's parameters; those after them are constexprs), and the
    positions it may assume are multiples of 16: the aligned pointers, and the keyed and divisible integers that are."""
    names = getattr(kernels_of(kernel.block), kernel.which).arg_names
    types, div16 = {}, []
    for i, (name, a) in enumerate(zip(names, args)):
        if isinstance(a, torch.Tensor):
            types[name] = "*" + _TRITON_TYPES[a.dtype]
            if not a.data_ptr() & 15:
                div16.append(i)
        elif isinstance(a, int):
            types[name] = "i32"
            if (i in kernel.keyed or i in kernel.divisible) and not a & 15:
                div16.append(i)
        else:
            types[name] = "fp32"
    for name in names[len(args):]:
        types[name] = "constexpr"
    return types, div16


def binary(kernel: FusedKernel, args: tuple, consts: tuple, warps: int, target):
    """The CompiledKernel of `kernel` for `args` and its constexprs `consts` (BLOCK, ...) on `target` (a triton
    GPUTarget), through Triton's cache."""
    import triton
    from triton.compiler import ASTSource

    types, div16 = signature(args, kernel)
    source = ASTSource(getattr(kernels_of(kernel.block), kernel.which), types,
                       constexprs={(len(args) + i,): v for i, v in enumerate(consts)},
                       attrs={(i,): [["tt.divisibility", 16]] for i in div16})
    return triton.compile(source, target=target, options={"num_warps": warps})


def _compile(kernel: FusedKernel, args: tuple, consts: tuple, warps: int, device: torch.device):
    """launch(grid_x, *args) through Triton's C launcher for a binary compiled for `args`, or None where Triton's JIT
    launches the kernel: this Triton's launcher is one we do not know, or a dtype is not one compiled here (fp64)."""
    import triton

    if any(isinstance(a, torch.Tensor) and a.dtype not in _TRITON_TYPES for a in args):
        return None

    with torch.cuda.device(device):
        compiled = binary(kernel, args, consts, warps, triton.runtime.driver.active.get_current_target())
        compiled._init_handles()          # loads the cubin into this device's context
    return CompiledHandle(compiled, device.index).grid_launcher()


def _launch(kernel: FusedKernel, grid_x: int, args: tuple, consts: tuple, warps: int, fits_i32: bool) -> None:
    """Run `kernel` over grid_x programs on the current stream of its first tensor's device, its constexprs (BLOCK,
    ...) `consts`. `fits_i32`: every integer argument fits a 32-bit one (else Triton's JIT passes them as 64-bit)."""
    first = args[0]
    with _on_device_of(first):
        if fits_i32 and first.is_cuda and not launch_hooks_installed():
            full = (kernel, first.device.index, consts, warps, specialisation_key(args, kernel))
            launch = _compiled.get(full, _MISSING)
            if launch is _MISSING:
                launch = _compiled[full] = _compile(kernel, args, consts, warps, first.device)
            if launch is not None:
                launch(grid_x, *args, *consts)      # Triton's launcher takes the constexprs too, and skips them
                return
        getattr(kernels_of(kernel.block), kernel.which)[(grid_x,)](*args, *consts, num_warps=warps)


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    keep_rstd: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, rstd) for x (..., N), contiguous or 2-D rows with a unit column stride, and weight (N,): y as x's dtype and
    shape, rstd fp32 (rows,), or None without `keep_rstd` (a call without grad)."""
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if x.is_contiguous():
        stride = width          # not x.stride(-2): a size-1 dim's stride is anything in a contiguous tensor
    elif x.dim() == 2 and x.stride(1) == 1:
        stride = x.stride(0)
    else:
        raise ValueError(f"rmsnorm_forward: x must be contiguous or 2-D rows with a unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device) if keep_rstd else None
    if rows:
        block, warps = _row_launch(width)
        _launch(RMSNORM_FORWARD, rows, (x, weight, y, y if rstd is None else rstd, stride, width, width, float(eps)),
                (block, keep_rstd), warps, max(rows, stride) <= _I32_MAX)
    return y, rstd


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) from the forward's rows x and rstd."""
    rows, width = x.shape
    dx = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    programs = max(1, min(rows, _programs(x.device)))
    partial = torch.zeros((programs, width), dtype=torch.float32, device=x.device)
    if rows:
        block, warps = _row_launch(width)
        _launch(RMSNORM_BACKWARD, programs, (dy, x, weight, rstd, dx, partial, dy.stride(0), x.stride(0), width, rows,
                                              width, cdiv(rows, programs)), (block,), warps,
                max(rows, dy.stride(0), x.stride(0)) <= _I32_MAX)
    return dx, partial.sum(0).to(weight.dtype)


def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    h = torch.empty_like(g)
    numel = g.numel()
    if numel:
        _launch(SWIGLU_FORWARD, cdiv(numel, _ELEMENTWISE_BLOCK), (g, u, h, numel), (_ELEMENTWISE_BLOCK,), 4,
                numel <= _I32_MAX)
    return h


def swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = torch.empty_like(g), torch.empty_like(u)
    numel = g.numel()
    if numel:
        _launch(SWIGLU_BACKWARD, cdiv(numel, _ELEMENTWISE_BLOCK), (dh, g, u, dg, du, numel), (_ELEMENTWISE_BLOCK,), 4,
                numel <= _I32_MAX)
    return dg, du


__all__ = ["FUSED_TEMPLATES", "MAX_ROW", "RMSNORM_BACKWARD", "RMSNORM_FORWARD", "SWIGLU_BACKWARD", "SWIGLU_FORWARD",
           "FusedKernel", "binary", "kernels_of", "rmsnorm_backward", "rmsnorm_forward", "signature",
           "specialisation_key", "swiglu_backward", "swiglu_forward"]
