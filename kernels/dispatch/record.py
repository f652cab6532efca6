"""Problem traces: record the problems a process looks up, and replay a listed problem as a user's first call meets it.

Recording (KERNELS_RECORD=path.jsonl, or `with kernels.record(path):`): the api calls `note` on every cold lookup
(never on a warm call: the warm table and the C++ table do not come here); each distinct problem is appended once per
process and file, as one JSON line (GemmProblem's own dict, and `dynamic_spec` for a dynamic problem), which
kernels.tune.problem_list reads back. Appends are one write(2) of a line of ~400 bytes to a file opened with
O_APPEND, under PIPE_BUF: processes recording into one file do not interleave. A failed write warns once and never
reaches the caller.

Replaying (`python -m kernels tune`): `stored` peeks at the selection store without loading anything; `replay`
makes operands with the problem's strides and alignment and resolves them through the api's own path.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator

import torch

from kernels.core import counters
from kernels.core.cache_root import warn_once
from kernels.core.config import config
from kernels.core.errors import InputTypeError, InputValueError
from kernels.core.fsutil import open_regular
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection
from kernels.dispatch import dynamic as _dynamic
from kernels.dispatch import selected
from kernels.measure.verify import make_inputs
from kernels.store.selections import SelectionStore, store_key
from kernels.store.shared import store_for
from kernels.tune.autotune import fingerprint
from kernels.tune.problem_list import DynamicSpec, Listed, line_of

_lock = threading.Lock()
_open_blocks: list[str] = []                 # the paths of the kernels.record() blocks now open
_written: set[tuple[str, str]] = set()       # (path, line) this process appended (or failed to)


# -- recording ---------------------------------------------------------------------------------------------------
def trace_line(problem: GemmProblem, dyn=None) -> str:
    """The problem's trace line; `dyn` the resolved kernels.Dynamic it was looked up under (None: static)."""
    if dyn is None:
        return line_of(Listed(problem, None, "")) + "\n"
    spec = DynamicSpec(tuple(dyn.hints), dyn.mode, dyn.buckets, dyn.pool)
    return line_of(Listed(dataclasses.replace(problem, dynamic=tuple(dyn.dims)), spec, "")) + "\n"


def note(problem: GemmProblem, dyn=None) -> None:
    """A cold lookup of `problem`: append it to each active trace that does not have it from this process yet."""
    targets = ([config.record] if config.record else []) + _open_blocks
    if not targets:
        return
    line = trace_line(problem, dyn)
    for path in targets:
        with _lock:
            if (path, line) in _written:
                continue
            _written.add((path, line))
        _append(path, line)


def _ends_cut(path: str) -> bool:
    """Whether the file at `path` ends in a line cut short (no newline): an append that stopped part way, as on a
    full disk. The next line then starts on a line of its own, so the cut one is all that is lost."""
    try:
        fd = open_regular(path)
        try:
            size = os.fstat(fd).st_size
            return size > 0 and os.pread(fd, 1, size - 1) != b"\n"
        finally:
            os.close(fd)
    except OSError:
        return False


def _append(path: str, line: str) -> None:
    data = (b"\n" if _ends_cut(path) else b"") + line.encode()
    try:
        fd = open_regular(path, append=True)      # a FIFO or a device never blocks the user's call
        try:
            written = os.write(fd, data)
        finally:
            os.close(fd)
        if written != len(data):
            raise OSError(f"short write: {written} of {len(data)} bytes")
    except OSError as e:
        warn_once(f"record:{path}", f"kernels: cannot append to the problem trace {path} ({e}); problems are not "
                  "recorded there", stacklevel=3)


def resolve(problem: GemmProblem, dyn=None):
    """A cold lookup: the problem's launcher (tuning or loading it), noted in the active traces first, with
    torch-function modes and subclasses off meanwhile: the torch calls a tune makes (timing aten, the float64
    reference) are its own, and neither a user's mode nor kernels.enabled() may see or reroute them (a rerouted
    torch.mm inside a tune would start a nested tune). The api's and scaled_mm's cold paths both call it."""
    note(problem, dyn)
    with torch._C.DisableTorchFunction():
        return selected.launcher_for(problem) if dyn is None else _dynamic.launcher_for(problem, dyn)


@contextlib.contextmanager
def record(path: str | os.PathLike) -> Iterator[str]:
    """Append each distinct problem looked up while the block runs to the JSON-lines file `path` (as
    KERNELS_RECORD does for a whole process), for `python -m kernels tune path`. Only cold lookups are recorded: a
    problem this process already serves from memory is not looked up again (enter the block before the calls, or
    call kernels.clear_memory_cache() first). Yields the absolute path."""
    if not isinstance(path, (str, os.PathLike)):
        raise InputTypeError(f"kernels.record: path must be a str or os.PathLike, got {type(path).__name__}")
    target = os.path.abspath(os.path.expanduser(os.fspath(path)))
    if not os.fspath(path).strip() or os.path.isdir(target):
        raise InputValueError(f"kernels.record: {os.fspath(path)!r} is not a file path")
    if os.path.exists(target) and not os.path.isfile(target):      # a FIFO, a device: appends would block or vanish
        raise InputValueError(f"kernels.record: {os.fspath(path)!r} is not a regular file (a FIFO or a device)")
    with _lock:
        _open_blocks.append(target)
    try:
        yield target
    finally:
        with _lock:
            _open_blocks.remove(target)


# -- replaying ---------------------------------------------------------------------------------------------------
_store = SelectionStore()


def stored(problem: GemmProblem) -> Selection | None:
    """The selection store's entry for a static problem under the current settings (else the shared store's, with
    KERNELS_STORE), or None; nothing is loaded or verified (a cold lookup does that on first use). An entry whose
    duel was left to calls (Selection.duel) is not final: None unless KERNELS_DUEL=calls, under which calls finish
    it (an offline tune runs its duels in the loop, so it tunes such a problem again)."""
    key = store_key(problem, fingerprint(config.backends))
    found = _store.get(key)
    shared = store_for(config.store, config.store_lock_s) if found is None else None
    found = found if shared is None else shared.get(key)
    return None if found is not None and found.awaiting_calls and config.duel != "calls" else found


def replay(item: Listed) -> tuple[Selection, bool]:
    """Look the problem up as a user's first call does: fresh operands on its device with its strides and alignment,
    its fp32 precision set meanwhile, then memory -> store -> tune (what the api's cold path, `resolve` above, runs).
    Returns the Selection and whether this tuned (or benchmarked a dynamic bucket) rather than read the store."""
    problem = item.problem
    device = "cuda" if problem.device == "cuda" else "cpu"
    operands = make_inputs(problem, device, seed=0)
    before = counters.snapshot()
    with _precision(problem.precision), torch._C.DisableTorchFunction():
        met = GemmProblem.from_tensors(problem.op, operands[0], operands[1], bias=problem.bias,
                                       activation=problem.activation, scaling=problem.scaling,
                                       out_dtype=problem.out_dtype)
        if problem.dynamic:
            sel = _dynamic.explain(met, _declared(item))
        else:
            selected.launcher_for(met)
            sel = selected.selection(met)
    after = counters.snapshot()
    return sel, any(after[k] > before[k] for k in ("tunes", "bucket_benchmarks"))


def _declared(item: Listed):
    spec = item.dynamic
    if spec is None:
        return _dynamic.Dynamic(item.problem.dynamic).resolved()
    return _dynamic.Dynamic(item.problem.dynamic, hints=spec.hints, mode=spec.mode, buckets=spec.buckets,
                            pool=spec.pool).resolved()


@contextlib.contextmanager
def _precision(precision: str) -> Iterator[None]:
    """torch's fp32 matmul precision as the problem was met ('ieee' or 'tf32'); '' leaves it alone."""
    if not precision:
        yield
        return
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest" if precision == "ieee" else "high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)
