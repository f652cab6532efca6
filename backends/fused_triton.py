"""The fused blocks' kernels (templates/triton/rmsnorm.py.jinja, swiglu.py.jinja): rendered once per process,
published under the Triton backend's source folder by content hash and loaded from their checked bytes, as the GEMM
families' modules are (backends.triton_modules); launched through Triton's JIT, which compiles each on its first
launch into Triton's own cache. No tuning: one configuration per row width.

The functions take and return torch tensors; they check nothing the caller (kernels.dispatch.fused) has not:
2-D rows with a unit column stride for RMSNorm, contiguous tensors of one shape for SwiGLU.
"""
from __future__ import annotations

import contextlib
import functools

import torch

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


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) for rows x (M, N), weight (N,): y as x's dtype, rstd fp32 (M,)."""
    rows, width = x.shape
    y = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    rstd = torch.empty((rows,), dtype=torch.float32, device=x.device)
    if rows:
        block, warps = _row_launch(width)
        with _on_device_of(x):
            kernels_of("rmsnorm").forward[(rows,)](x, weight, y, rstd, x.stride(0), y.stride(0), width, float(eps),
                                                   BLOCK=block, num_warps=warps)
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
        with _on_device_of(x):
            kernels_of("rmsnorm").backward[(programs,)](dy, x, weight, rstd, dx, partial, dy.stride(0), x.stride(0),
                                                        dx.stride(0), rows, width, cdiv(rows, programs),
                                                        BLOCK=block, num_warps=warps)
    return dx, partial.sum(0).to(weight.dtype)


def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    h = torch.empty_like(g)
    numel = g.numel()
    if numel:
        with _on_device_of(g):
            kernels_of("swiglu").forward[(cdiv(numel, _ELEMENTWISE_BLOCK),)](g, u, h, numel,
                                                                                     BLOCK=_ELEMENTWISE_BLOCK)
    return h


def swiglu_backward(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dg, du = torch.empty_like(g), torch.empty_like(u)
    numel = g.numel()
    if numel:
        with _on_device_of(g):
            kernels_of("swiglu").backward[(cdiv(numel, _ELEMENTWISE_BLOCK),)](dh, g, u, dg, du, numel,
                                                                                      BLOCK=_ELEMENTWISE_BLOCK)
    return dg, du


__all__ = ["FUSED_TEMPLATES", "MAX_ROW", "kernels_of", "rmsnorm_backward", "rmsnorm_forward", "swiglu_backward",
           "swiglu_forward"]
