"""The store's one file protocol: a JSON object per key under <cache dir>/<subdir>/, named by the key's sha256 and
carrying the key itself (a hash collision or a foreign file reads as a miss), published atomically (temp file +
fsync + os.replace), with a per-key advisory lock for the read-decide-write sequences (tune once across processes,
merge a bucket decision). Reading never raises: missing, truncated or non-object files are misses."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kernels.core.config import config
from kernels.core.fsutil import atomic_write_text, file_lock, read_json


class KeyedJsonStore:
    subdir = ""              # under the cache dir; the root given to __init__ wins (tests, tools)

    def __init__(self, root: Path | None = None):
        self._root = Path(root) if root is not None else None

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else Path(config.cache_dir) / self.subdir

    def path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def read(self, key: str) -> dict | None:
        """The entry's object for exactly this key, or None."""
        data = read_json(self.path(key))
        return data if data is not None and data.get("key") == key else None

    def write(self, key: str, body: dict) -> None:
        atomic_write_text(self.path(key), json.dumps({"key": key, **body}, indent=1, sort_keys=True))

    def lock(self, key: str):
        """Exclusive per-key lock (context manager), released by the OS if the holder dies."""
        return file_lock(self.root / "locks" / (self.path(key).stem + ".lock"), config.lock_timeout_s)
