"""The store's one file protocol: a JSON object per key under <cache dir>/<subdir>/, named by the key's sha256 and
carrying the key itself (a hash collision or a foreign file reads as a miss), published atomically (temp file +
fsync + os.replace), with a per-key advisory lock for the read-decide-write sequences (tune once across processes,
merge a bucket decision). Reading never raises: missing, truncated or non-object files are misses. Writing and
locking never raise either: what stands in an entry's or lock's way inside the store (a directory at its path, a
plain file where its folder belongs) is removed, and what still fails degrades to working without the file."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import stat
import warnings
from pathlib import Path

from kernels.core import fsutil
from kernels.core.cache_root import CacheWarning, cache_root, kernels_own, warn_once
from kernels.core.fsutil import atomic_write_text, file_lock, is_dir_no_link, read_json

# How long a process waits for another's lock on the same entry before it says so: a tune usually finishes well within
# this, so a longer wait is worth a line explaining why the call is slow (the wait goes on, up to LOCK_TIMEOUT_S)
SLOW_LOCK_WARN_S = 30.0
# the errors that mean something stands where the store's file or folder belongs (not a full disk, not a mode)
_IN_THE_WAY = (NotADirectoryError, IsADirectoryError, FileExistsError)


def _warn_unwritable(root: Path, error: OSError) -> None:
    warn_once(f"unwritable {root}", f"kernels: cannot write to the cache {root} ({error.strerror or error}); results "
              "are kept in memory for this process only", stacklevel=4)


def _warn_unlockable(root: Path, lock: Path, error: OSError) -> None:
    # one warning per cache with the write failure's: a cache that refuses both (read-only, full) says so once
    warn_once(f"unwritable {root}", f"kernels: cannot make the lock {lock} ({error.strerror or error}); going on "
              "without it (another process may do the same work at once); an entry that cannot be written either is "
              "kept in memory for this process only", stacklevel=6)


class KeyedJsonStore:
    subdir = ""              # under the cache dir; the root given to __init__ wins (tests, tools)
    held_for = "working on the same entry"     # what another process holding an entry's lock is doing, for warnings

    def __init__(self, root: Path | None = None):
        self._root = Path(root) if root is not None else None

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else cache_root() / self.subdir

    @property
    def top(self) -> Path:
        """The store's outermost folder of its own (<cache dir>/selections for selections/dynamic): what is in the
        way at or below it may be removed."""
        return self._root if self._root is not None else cache_root() / Path(self.subdir).parts[0]

    def path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def lock_path(self, key: str) -> Path:
        return self.root / "locks" / (self.path(key).stem + ".lock")

    def read(self, key: str) -> dict | None:
        """The entry's object for exactly this key, or None (a symbolic link in its place too: nothing in the cache is
        one, `cache verify` says, and the next write replaces it)."""
        data = read_json(self.path(key), follow=False)
        return data if data is not None and data.get("key") == key else None

    def write(self, key: str, body: dict) -> bool:
        """Best effort: a full disk, a read-only or unwritable cache warns once per process and the caller keeps its
        result in memory (a failed write must never lose what was just tuned). What stands in the entry's way in the
        store is removed first (clear_the_way). True when written."""
        text = json.dumps({"key": key, **body}, indent=1, sort_keys=True)
        try:
            atomic_write_text(self.path(key), text)
            return True
        except OSError as e:
            failed = e
        try:
            if isinstance(failed, _IN_THE_WAY) and self.clear_the_way(self.path(key)):
                atomic_write_text(self.path(key), text)
                return True
        except OSError as e:
            failed = e
        _warn_unwritable(self.root, failed)
        return False

    def clear_the_way(self, path: Path) -> bool:
        """Remove what keeps a file from being made at `path` in this store: a non-directory where one of its folders
        belongs (a plain file at selections/), else a directory at `path` itself. Only those exact paths, never
        through a link (the cache is kernels' own folder: nothing of its own is ever there). One warning per thing
        removed; True when something was. OSError when it cannot be removed."""
        top = self.top
        if self._root is None and not kernels_own(top.parent):
            return False                     # KERNELS_CACHE_DIR names a folder of the user's: nothing is removed
        folders = [f for f in reversed(path.parents) if f == top or top in f.parents]
        for folder in folders:
            try:
                mode = os.lstat(folder).st_mode
            except FileNotFoundError:
                break
            if stat.S_ISLNK(mode):
                return False                 # a link is neither removed nor followed
            if not stat.S_ISDIR(mode):
                os.unlink(folder)
                return self._removed(folder, "a plain file where a folder of the store belongs")
        if is_dir_no_link(path):
            shutil.rmtree(path)
            return self._removed(path, "a directory where a file of the store belongs")
        return False

    @staticmethod
    def _removed(path: Path, what: str) -> bool:
        warnings.warn(f"kernels: removed {what}: {path}", CacheWarning, stacklevel=5)
        return True

    @contextlib.contextmanager
    def lock(self, key: str):
        """Exclusive per-key lock, released by the OS if the holder dies. A cache where no lock file can be made
        (read-only, full, not ours) warns once and goes on unlocked: at worst two processes tune the same problem.
        A holder that is alive but stuck is waited for (one warning after SLOW_LOCK_WARN_S) up to
        fsutil.LOCK_TIMEOUT_S, then the caller goes on unlocked rather than lose its call (one warning)."""
        with contextlib.ExitStack() as held:
            self._take_lock(held, self.lock_path(key))
            yield

    def _take_lock(self, held: contextlib.ExitStack, path: Path) -> None:
        total = fsutil.LOCK_TIMEOUT_S       # read per call: the module attribute is the documented setting
        first = min(SLOW_LOCK_WARN_S, total)
        try:
            held.enter_context(self._file_lock(path, first))
            return
        except TimeoutError:                 # an OSError too: another process holds it, no fault of the cache
            pass
        except OSError as e:
            _warn_unlockable(self.root, path, e)
            return
        warnings.warn(f"kernels: waited {first:.0f} s for the lock {path}: another process holds it ({self.held_for}); "
                      f"waiting up to {total - first:.0f} s more", CacheWarning, stacklevel=5)
        try:
            held.enter_context(file_lock(path, total - first))
        except TimeoutError:
            warnings.warn(f"kernels: gave up after {total:.0f} s waiting for the lock {path} (its holder is alive but "
                          f"does not finish); proceeding unlocked", CacheWarning, stacklevel=5)
        except OSError as e:
            _warn_unlockable(self.root, path, e)

    @contextlib.contextmanager
    def _file_lock(self, path: Path, timeout_s: float):
        """file_lock, once more after clearing what stands at the lock's path (a directory there, a plain file at
        locks/) when the first try fails for that."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(file_lock(path, timeout_s))
            except _IN_THE_WAY:
                if not self.clear_the_way(path):
                    raise
                held.enter_context(file_lock(path, timeout_s))
            yield
