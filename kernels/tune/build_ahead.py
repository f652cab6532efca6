"""Builds ahead: while a tune verifies and times one problem on the GPU, the candidates of the problems its caller
will tune next are compiled in the background (CPU only), so each does not wait for its own compiles in turn.

A layer's first forward with grad knows its backward products (dX, dW) before it tunes its forward one
(kernels.dispatch.api): on the H100 a llama-7B layer's three first problems spent 3.5, 1.1 and 1.1 s compiling, one
after the other, and ~1.3 s each on the GPU (twenty-fourth session). The caller names them with `coming`; the next
tune in that thread starts their build once its own build is done (`start_after_build`), so the foreground's
compiles come first, and the two meet only in the artifact store's per-kernel locks (a kernel being compiled ahead is
waited for, never compiled twice). Only backends whose builds take seconds in the compile workers build ahead
(`Backend.builds_ahead`: Triton, padded); CUTLASS has its own background build.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

from backends import get_backend
from kernels.core.problem import GemmProblem

_pending = threading.local()


@dataclass
class Coming:
    """What a thread will tune next: the problems, the backends, and which problems still need a tune (asked in
    the background: a stored selection needs no candidates built)."""
    problems: list[GemmProblem]
    backends: tuple[str, ...]
    needed: Callable[[GemmProblem], bool]


@contextlib.contextmanager
def coming(problems: list[GemmProblem], backends: tuple[str, ...],
           needed: Callable[[GemmProblem], bool] = lambda problem: True):
    """Within the block, the next tune in this thread starts building `problems` ahead once its own build is done;
    once only (later tunes in the block find nothing left to start)."""
    previous = getattr(_pending, "work", None)
    _pending.work = Coming(list(problems), tuple(backends), needed) if problems else None
    try:
        yield
    finally:
        _pending.work = previous


def start_after_build(prebuild: Callable[[list[GemmProblem], tuple[str, ...]], object]) -> threading.Thread | None:
    """Called by a tune once its own build is done: starts `prebuild(problems, backends)` in a daemon thread for what
    `coming` registered in this thread (the backends that build ahead only), or does nothing."""
    work = getattr(_pending, "work", None)
    if work is None:
        return None
    _pending.work = None
    ahead = tuple(name for name in work.backends if _builds_ahead(name))
    if not ahead:
        return None
    thread = threading.Thread(target=_build, args=(work, ahead, prebuild), name="kernels-build-ahead", daemon=True)
    thread.start()
    return thread


def _builds_ahead(name: str) -> bool:
    try:
        return bool(get_backend(name).builds_ahead)
    except Exception:  # noqa: BLE001 - a backend that does not load builds nothing ahead; its tune reports why
        return False


def _build(work: Coming, backends: tuple[str, ...], prebuild) -> None:
    """Best effort: whatever fails here fails again, with its reason, in the problem's own tune."""
    try:
        problems = [p for p in work.problems if work.needed(p)]
        if problems:
            prebuild(problems, backends)
    except Exception:  # noqa: BLE001
        pass
