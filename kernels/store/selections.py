"""Persistent selection store: one JSON file per (problem, environment), published atomically, guarded by a
per-problem lock so processes tuning the same problem at once tune it once."""
from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from pathlib import Path

from kernels.core.config import config
from kernels.core.fsutil import atomic_write_text, file_lock, read_json
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection


def store_key(problem: GemmProblem, fingerprint: dict) -> str:
    return json.dumps({"problem": problem.key(), "env": fingerprint}, sort_keys=True)


class SelectionStore:
    def __init__(self, root: Path | None = None):
        self._root = Path(root) if root is not None else None

    @property
    def root(self) -> Path:
        return self._root if self._root is not None else Path(config.cache_dir) / "selections"

    def _path(self, key: str) -> Path:
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"

    def get(self, key: str) -> Selection | None:
        """The stored selection, or None when absent, corrupt, of another schema, or for another key."""
        path = self._path(key)
        data = read_json(path)
        if data is None:
            if path.exists():
                warnings.warn(f"kernels: ignoring unreadable selection cache entry {path}", stacklevel=3)
            return None
        if data.get("key") != key:
            return None
        try:
            return Selection.from_dict(data.get("selection", {}), source="disk")
        except (KeyError, TypeError, ValueError) as e:
            warnings.warn(f"kernels: ignoring bad selection cache entry {path}: {e}", stacklevel=3)
            return None

    def put(self, key: str, selection: Selection) -> None:
        atomic_write_text(self._path(key), json.dumps({"key": key, "selection": selection.to_dict()}, indent=1))

    @contextlib.contextmanager
    def lock(self, key: str):
        lock_path = self.root / "locks" / (self._path(key).stem + ".lock")
        with file_lock(lock_path, config.lock_timeout_s):
            yield
