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
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import time
import uuid
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def make_private_dirs(path: Path) -> None:
    """Create `path` and its missing parents as 0700, whatever the umask (an existing directory is left as is)."""
    missing = []
    here = path
    while not os.path.lexists(here):
        missing.append(here)
        here = here.parent
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue
        os.chmod(folder, 0o700)


def _private_parent(path: Path) -> None:
    if not path.parent.is_dir():
        make_private_dirs(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    """Readers see the old file or the new one, never a partial write (atomic_write_bytes of the UTF-8 text)."""
    atomic_write_bytes(path, text.encode())


# the temporary atomic_write_bytes makes beside its target: a writer killed before os.replace leaves it behind
ATOMIC_TEMP = re.compile(r"\..+\.(?P<writer>\d+)\.[0-9a-f]{8}\.tmp")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Readers see the old file or the new one, never a partial write: a fresh temp file (O_EXCL, never following a
    planted link, 0600 whatever the umask) in the same directory, fsync, then os.replace, which replaces a link at
    `path` rather than writing through it."""
    _private_parent(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            os.fchmod(fd, 0o600)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_if_different(path: Path, text: str) -> bool:
    """Write only when content changed, so mtimes (and tools keyed on them) stay stable. True if written."""
    try:
        if read_regular(path, MAX_JSON_BYTES).decode() == text:
            return False
    except (OSError, UnicodeDecodeError):      # missing, or not a plain file of ours: replaced
        pass
    atomic_write_text(path, text)
    return True


# the JSON files kept or read here (selections, markers, records, lookup tables) are KiBs to MiBs
MAX_JSON_BYTES = 64 << 20


def open_regular(path: str | os.PathLike, follow: bool = True, append: bool = False) -> int:
    """A descriptor open for reading (for appending with `append`, the file made if missing) on the regular file at
    `path`, blocking, close-on-exec; the caller closes it. Anything else in its place -- a FIFO (opened without
    blocking, then refused), a device such as /dev/zero -- raises OSError (EINVAL, "not a regular file", the path), a
    directory IsADirectoryError, as a missing file raises FileNotFoundError: a reader never hangs on it nor reads it
    endlessly, a writer never blocks on it. A symlink is followed (a user's table may be one) unless `follow` is off
    (then it raises OSError: ELOOP)."""
    access = os.O_WRONLY | os.O_APPEND | os.O_CREAT if append else os.O_RDONLY
    try:
        fd = os.open(path, access | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW), 0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:      # a FIFO opened to write without blocking, no reader at its other end
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path)) from e
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):          # what open(2) itself says of one: clearer than "not a regular file"
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.fspath(path))
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", os.fspath(path))
        os.set_blocking(fd, True)       # O_NONBLOCK was only for the open: reads of a regular file never block
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_dir_no_link(path: Path) -> bool:
    """A directory itself, not a link to one (nor anything missing)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def read_tail(path: Path, size: int) -> bytes:
    """The last `size` bytes of a regular file (see open_regular): a long log's end without reading it whole."""
    fd = open_regular(path)
    try:
        os.lseek(fd, max(0, os.fstat(fd).st_size - size), os.SEEK_SET)
        chunks = []
        while chunk := os.read(fd, size):
            chunks.append(chunk)
        return b"".join(chunks)[-size:]
    finally:
        os.close(fd)


def read_regular(path: Path, limit: int, follow: bool = True) -> bytes:
    """The bytes of a regular file of at most `limit` bytes. Anything else in its place (see open_regular), or a
    larger file, raises OSError, as a missing file does: a reader never hangs on it nor reads it whole."""
    fd = open_regular(path, follow)
    try:
        st = os.fstat(fd)
        if st.st_size > limit:
            raise OSError(errno.EFBIG, f"{st.st_size} bytes, over {limit}", str(path))
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise OSError(errno.EFBIG, f"grew over {limit} bytes while read", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_regular_text(path: Path, limit: int) -> str:
    """read_regular's bytes as UTF-8 text, newlines translated as Path.read_text does (\\r\\n and \\r read as \\n):
    raises OSError, or UnicodeDecodeError (a ValueError)."""
    return read_regular(path, limit).decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def read_json(path: Path, follow: bool = True) -> dict | None:
    """The parsed object, or None when missing, unreadable, not a regular file of at most MAX_JSON_BYTES, or not a
    JSON object (a corrupt entry is a miss); `follow=False`: a symbolic link is none either."""
    try:
        data = json.loads(read_regular(path, MAX_JSON_BYTES, follow))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):     # deep nesting: a miss too
        return None
    return data if isinstance(data, dict) else None


def json_file_problem(path: str | os.PathLike) -> str | None:
    """Why `path` is not a JSON file a command can read (a regular file of at most MAX_JSON_BYTES holding JSON), in
    words for an error line, or None when it is one."""
    try:
        json.loads(read_regular(Path(path), MAX_JSON_BYTES))
    except OSError as e:
        return e.strerror or str(e)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return f"not valid JSON ({e})"
    return None


# How long a process waits for another that holds the same lock (tuning one problem, building a CUTLASS batch): a
# tune may include an isolated child's 300 s (backends.child_handle.CHILD_TIMEOUT_S) besides its builds; a holder
# that dies drops its lock at once, so only a live, stuck one is ever waited out
LOCK_TIMEOUT_S = 600.0


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float | None = None):
    """Exclusive advisory lock; the OS drops it if the holder dies, so a killed run never wedges others. The timeout
    defaults to LOCK_TIMEOUT_S as it is when called (the module attribute is the documented knob)."""
    _private_parent(path)
    fd = _open_lock_file(path)
    try:
        timeout_s = LOCK_TIMEOUT_S if timeout_s is None else timeout_s
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


def _open_lock_file(path: Path) -> int:
    """The lock file itself, never what a link planted at its path points to: a link is removed (it sits in our
    private directory) and a plain file made in its place."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
    os.unlink(path)
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


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


def build_each_once(keys: list[str], lock_for: Callable[[str], Path], built: Callable[[str], bool],
                    build: Callable[[list[str]], None]) -> list[str]:
    """Build each key at most once across processes when several need the same ones at once (tuning workers on
    one host): the keys no other process holds are built here in one batch, under their locks; then each key another
    process holds is waited for, and whatever it left unbuilt (its build failed, it died) is built here. Returns
    the keys built here. Locks are taken without waiting while this process holds others, and waited for in sorted
    order, so two processes never wait on each other; one held past the lock timeout is built here anyway."""
    mine, theirs = [], []
    with contextlib.ExitStack() as held:
        for key in keys:
            try:
                held.enter_context(file_lock(lock_for(key), timeout_s=0))
            except TimeoutError:
                theirs.append(key)
                continue
            if not built(key):                  # checked under the lock: another process may have just finished it
                mine.append(key)
        if mine:
            build(mine)
    if not theirs:
        return mine
    with contextlib.ExitStack() as held:
        try:
            for key in sorted(theirs):
                held.enter_context(file_lock(lock_for(key)))
        except TimeoutError:
            pass        # a holder stuck past the lock timeout: build here rather than fail its candidates
        left = [key for key in theirs if not built(key)]
        if left:
            build(left)
    return mine + left


def file_sha256(path: Path) -> str:
    """sha256 of a regular file's bytes; OSError for anything else (a FIFO planted in a cache folder must not block
    the check that is meant to catch it: see open_regular)."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish_marker(binary: Path, marker: Path, key: str, info: dict) -> None:
    """Mark a built binary valid: written last, records size and hash so a truncated or swapped file is a miss."""
    meta = dict(info, key=key, size=binary.stat().st_size, sha256=file_sha256(binary))
    atomic_write_text(marker, json.dumps(meta, sort_keys=True, indent=1))


def marker_claims(binary: Path, marker: Path, key: str) -> dict | None:
    """The marker when it was published for this key and the binary has the size it records: what a check without
    reading the binary can say (a cold lookup asking whether a build finished); None otherwise. marker_valid also
    hashes the binary, and only a valid binary is loaded."""
    meta = read_json(marker)
    if meta is None or meta.get("key") != key:
        return None
    try:
        if binary.stat().st_size != meta.get("size"):
            return None
    except OSError:
        return None
    return meta


def marker_valid(binary: Path, marker: Path, key: str) -> bool:
    """The binary is the one its marker published for this key (same size and sha256)."""
    meta = marker_claims(binary, marker, key)
    try:
        return meta is not None and file_sha256(binary) == meta.get("sha256")
    except OSError:         # gone since the stat, or not a regular file: not the binary the marker published
        return False
