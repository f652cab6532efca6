"""kernels: autotuned GEMM templates (Triton, CUTLASS) beside aten, for PyTorch.

    import kernels
    c = kernels.mm(a, b)            # fp16 / bf16 / fp32
    c = kernels.int_mm(a8, b8)      # int8 x int8 -> int32
    c = kernels.scaled_mm(a8, b8, scale_a, scale_b)   # fp8 (e4m3) with per-tensor or row-wise scales
    y = kernels.linear(x, weight, bias, activation="gelu")     # nn.Linear's layout, epilogue fused
    kernels.explain(a, b).winner
    c = kernels.mm(x, w, dynamic="m")   # M varies: one winner per size hint, each new M served by one of them
    kernels.patch(model)            # every nn.Linear through kernels.linear, RMSNorm / SwiGLU blocks fused (unpatch)
    with kernels.enabled(): ...     # torch.mm / matmul / F.linear / addmm inside go through kernels
    with kernels.record("trace.jsonl"): ...   # the problems met inside, for `python -m kernels tune trace.jsonl`
    kernels.preload()               # at startup: load and verify every stored winner of this GPU now

mm and linear are differentiable and torch.compile traces them as custom ops (kernels::mm, kernels::linear).

The package root is lazy (PEP 562): `import kernels.core.problem` (a backend, a compile worker, a tool) does not
load the dispatch and tuning chain; `kernels.mm` does, on first access.
"""
from __future__ import annotations

import importlib

# public name -> the module that defines it
_EXPORTS = {
    "mm": "kernels.dispatch.api", "int_mm": "kernels.dispatch.api", "linear": "kernels.dispatch.api",
    "explain": "kernels.dispatch.api", "stats": "kernels.dispatch.api", "clear_memory_cache": "kernels.dispatch.api",
    "fastpath_status": "kernels.dispatch.api", "load_fastpath": "kernels.dispatch.api",
    "patch": "kernels.dispatch.patch", "unpatch": "kernels.dispatch.patch", "enabled": "kernels.dispatch.mode",
    "Dynamic": "kernels.dispatch.dynamic", "record": "kernels.dispatch.record", "config": "kernels.core.config",
    "preload": "kernels.dispatch.preload", "scaled_mm": "kernels.dispatch.api",
    "__version__": "kernels.core.version",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value          # later lookups skip __getattr__: warm calls pay one dict lookup, as before
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
