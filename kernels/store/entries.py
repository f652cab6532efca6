"""The store's one file protocol: a JSON object per key under <cache dir>/<subdir>/, named by the key's sha256 and
carrying the key itself (a hash collision or a foreign file reads as a miss), published atomically (temp file +
fsync + os.replace), with a per-key advisory lock for the read-decide-write sequences (tune once across processes,
merge a bucket decision). Reading never raises: missing, truncated or non-object files are misses."""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from kernels.core.cache_root import cache_root, warn_once
from kernels.core.fsutil import atomic_write_text, file_lock, read_json


def _warn_unwritable(root: Path, error: OSError) -> None:
    warn_once(f"unwritable {root}", f"kernels: cannot write to the cache {root} ({error.strerror or error}); results "
              "are kept in memory for this process only", stacklevel=4)


class KeyedJsonStore:
    subdir = ""              # under the cache dir; the root given to __init__ wins (tests, tools)

    def __init__(self, root: Path | None = None):
        self._root = Path(root) if root is not None else None

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else cache_root() / self.subdir

    def path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def read(self, key: str) -> dict | None:
        """The entry's object for exactly this key, or None."""
        data = read_json(self.path(key))
        return data if data is not None and data.get("key") == key else None

    def write(self, key: str, body: dict) -> bool:
        """Best effort: a full disk, a read-only or unwritable cache warns once per process and the caller keeps its
        result in memory (a failed write must never lose what was just tuned). True when written."""
        try:
            atomic_write_text(self.path(key), json.dumps({"key": key, **body}, indent=1, sort_keys=True))
            return True
        except OSError as e:
            _warn_unwritable(self.root, e)
            return False

    @contextlib.contextmanager
    def lock(self, key: str):
        """Exclusive per-key lock, released by the OS if the holder dies. A cache where no lock file can be made
        (read-only, full, not ours) warns once and goes on unlocked: at worst two processes tune the same problem."""
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(file_lock(self.root / "locks" / (self.path(key).stem + ".lock")))
            except TimeoutError:            # an OSError too, but another process holds it: that is no fault
                raise
            except OSError as e:
                _warn_unwritable(self.root, e)
            yield
