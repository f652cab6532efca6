"""kernels: autotuned GEMM templates (Triton, CUTLASS) beside aten, for PyTorch.

    import kernels
    c = kernels.mm(a, b)            # fp16 / bf16 / fp32
    c = kernels.int_mm(a8, b8)      # int8 x int8 -> int32
    kernels.explain(a, b).winner
    c = kernels.mm(x, w, dynamic="m")   # M varies: one winner per size hint, each new M served by one of them
"""
from kernels.api import clear_memory_cache, explain, fastpath_status, int_mm, load_fastpath, mm, stats
from kernels.config import config
from kernels.dynamic import Dynamic
from kernels.version import __version__

__all__ = ["mm", "int_mm", "explain", "stats", "config", "clear_memory_cache", "Dynamic", "fastpath_status",
           "load_fastpath", "__version__"]
