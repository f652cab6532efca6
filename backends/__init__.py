"""Backends turn Choices into Runners. Each is imported only when asked for, so `import kernels` stays cheap.

Kept free of torch imports: compile workers import `backends.triton_worker` and must start fast.
"""
from __future__ import annotations

import importlib

_MODULES = {"aten": "backends.aten", "triton": "backends.triton", "cutlass": "backends.cutlass",
            "padded": "backends.padded"}
_instances: dict = {}


def get_backend(name: str):
    """The process-wide instance of a backend (see backends.base.Backend)."""
    if name not in _MODULES:
        raise ValueError(f"unknown backend {name!r}; known: {', '.join(_MODULES)}")
    if name not in _instances:
        _instances[name] = importlib.import_module(_MODULES[name]).create()
    return _instances[name]


def close_all() -> None:
    for backend in _instances.values():
        backend.close()
    _instances.clear()
