"""The checks of an `out=` argument, shared by kernels.mm / int_mm and kernels.scaled_mm: `out_fits`, the warm
paths' test (a miss goes to the cold path), and `check_out`, the cold path's, so that each fault raises the same error
type whichever op it is passed to (the dtype a TypeError, the rest ValueError)."""
from __future__ import annotations

import torch

from kernels.core.errors import InputTypeError, InputValueError


def out_fits(out, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, *others: torch.Tensor | None) -> bool:
    """Whether `out` can take a @ b's `dtype` result as it is: anything else goes to `check_out` (an `out` with a zero
    stride anywhere, or sharing memory with a, b or any of `others` (scaled_mm's scales and bias), too: refused
    there, it never reaches a kernel)."""
    return (isinstance(out, torch.Tensor) and out.dtype is dtype and out.device == a.device
            and out.shape == (a.shape[0], b.shape[1]) and 0 not in out.stride()
            and not any(t is not None and overlaps(out, t) for t in (a, b, *others)))


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [first, last + 1) a strided tensor's elements lie in (strides are never negative in torch)."""
    if t.numel() == 0:
        return 0, 0
    start = t.data_ptr()
    return start, start + (sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1) * t.element_size()


def overlaps(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether x's and y's elements may share memory. Exact for tensors of different storages (never) and for two
    matrices with one row (or column) stride, as blocks of rows or columns of one buffer are; otherwise their spans
    meeting counts (views taking turns within one span, such as even and odd columns, are refused rather than
    checked element by element)."""
    if x.device != y.device or x.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
        return False
    xs, xe = _span(x)
    ys, ye = _span(y)
    if not (xs < ye and ys < xe):
        return False
    if x.dim() == y.dim() == 2 and x.element_size() == y.element_size() and x.numel() and y.numel():
        if x.stride(0) == 1 and y.stride(0) == 1 and x.stride(1) == y.stride(1):
            x, y = x.t(), y.t()                    # column-major blocks: the same question on their transposes
        if x.stride(1) == 1 and y.stride(1) == 1 and x.stride(0) == y.stride(0) >= max(x.shape[1], y.shape[1]):
            base, row = x.untyped_storage().data_ptr(), x.stride(0) * x.element_size()
            (xr, xc), (yr, yc) = divmod(x.data_ptr() - base, row), divmod(y.data_ptr() - base, row)
            width = x.element_size()
            if xc + x.shape[1] * width <= row and yc + y.shape[1] * width <= row:     # no window wraps a row
                rows_meet = xr < yr + y.shape[0] and yr < xr + x.shape[0]
                return rows_meet and xc < yc + y.shape[1] * width and yc < xc + x.shape[1] * width
    return True


def check_out(op: str, out, shape: tuple[int, int], dtype: torch.dtype, device: torch.device,
              inputs: dict[str, torch.Tensor] | None = None) -> None:
    """Raise InputTypeError / InputValueError naming what is wrong with `out` for a (shape) `dtype` result on
    `device`, read from `inputs` (name -> tensor)."""
    if not isinstance(out, torch.Tensor):
        raise InputTypeError(f"kernels.{op}: out must be a torch.Tensor, got {type(out).__name__}")
    if tuple(out.shape) != tuple(shape):
        raise InputValueError(f"kernels.{op}: out has shape {tuple(out.shape)}, expected {tuple(shape)}")
    if out.dtype != dtype:
        raise InputTypeError(f"kernels.{op}: out has dtype {out.dtype}, expected {dtype}")
    if out.device != device:
        raise InputValueError(f"kernels.{op}: out is on {out.device}, inputs on {device}")
    if any(st == 0 and size > 1 for st, size in zip(out.stride(), out.shape)):
        # torch refuses it too: which of the elements sharing memory is written last is undefined
        raise InputValueError(f"kernels.{op}: out has elements that share memory (strides {tuple(out.stride())}, "
                              f"an expanded tensor); pass a tensor whose elements are distinct")
    for name, t in (inputs or {}).items():
        if isinstance(t, torch.Tensor) and overlaps(out, t):
            # the kernel would read what it has already written: a wrong result, not an error (torch's CPU mm too)
            raise InputValueError(f"kernels.{op}: out shares memory with {name}; pass an out apart from the inputs")
