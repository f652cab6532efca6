"""Crash- and concurrency-safe file primitives: atomic publish, compare-before-write, advisory locks."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import uuid
from pathlib import Path


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
