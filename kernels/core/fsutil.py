"""Crash- and concurrency-safe file primitives: atomic publish, compare-before-write, advisory locks, and the one
lifecycle every cached thing follows (`load_or_build`).

The contract, for selections, bucket decisions and built binaries alike:
- load never raises for a missing, stale or corrupt entry: it is a miss (None);
- build runs under the entry's lock, after a second load (another process may have built it while we waited), and
  raises only when nothing usable can result;
- what build writes is published last and atomically (temp file + fsync + os.replace, or a marker written after
  the binary, recording its size and sha256), so a killed build leaves a miss, never a half-written entry.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def atomic_write_text(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a partial write (temp file + fsync + os.replace)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_if_different(path: Path, text: str) -> bool:
    """Write only when content changed, so mtimes (and tools keyed on them) stay stable. True if written."""
    try:
        if path.read_text() == text:
            return False
    except (FileNotFoundError, UnicodeDecodeError):
        pass
    atomic_write_text(path, text)
    return True


def read_json(path: Path) -> dict | None:
    """The parsed object, or None when missing, unreadable or not a JSON object (a corrupt entry is a miss)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float):
    """Exclusive advisory lock; the OS drops it if the holder dies, so a killed run never wedges others."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for lock {path}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.2)
        yield
    finally:
        os.close(fd)   # closing the descriptor releases the lock


def load_or_build(load: Callable[[], T | None], lock: Callable[[], contextlib.AbstractContextManager],
                  build: Callable[[], T]) -> T:
    """load() -> lock -> load() again -> build(): what is cached is built once across processes (see the module
    docstring for each step's contract). `lock()` returns the entry's lock as a context manager."""
    found = load()
    if found is not None:
        return found
    with lock():
        found = load()
        if found is not None:
            return found
        return build()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish_marker(binary: Path, marker: Path, key: str, info: dict) -> None:
    """Mark a built binary valid: written last, records size and hash so a truncated or swapped file is a miss."""
    meta = dict(info, key=key, size=binary.stat().st_size, sha256=file_sha256(binary))
    atomic_write_text(marker, json.dumps(meta, sort_keys=True, indent=1))


def marker_valid(binary: Path, marker: Path, key: str) -> bool:
    """The binary is the one its marker published for this key (same size and sha256)."""
    meta = read_json(marker)
    if meta is None or meta.get("key") != key:
        return False
    try:
        if binary.stat().st_size != meta.get("size"):
            return False
    except OSError:
        return False
    return file_sha256(binary) == meta.get("sha256")
