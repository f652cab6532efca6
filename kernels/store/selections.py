"""Persistent selection store: one JSON file per (problem, environment), published atomically, guarded by a
per-problem lock so processes tuning the same problem at once tune it once."""
from __future__ import annotations

import json
import warnings

from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection
from kernels.store.entries import KeyedJsonStore
from kernels.store.schema import problems


def store_key(problem: GemmProblem, fingerprint: dict) -> str:
    return json.dumps({"problem": problem.key(), "env": fingerprint}, sort_keys=True)


class SelectionStore(KeyedJsonStore):
    subdir = "selections"
    held_for = "tuning the same problem"

    def get(self, key: str) -> Selection | None:
        """The stored selection, or None when absent, corrupt, of another schema, or for another key."""
        path = self.path(key)
        data = self.read(key)
        if data is None:
            if path.exists():
                warnings.warn(f"kernels: ignoring unreadable selection cache entry {path}", stacklevel=3)
            return None
        why = problems(data.get("selection"))
        if why is not None:
            warnings.warn(f"kernels: ignoring bad selection cache entry {path}: {why}", stacklevel=3)
            return None
        try:
            return Selection.from_dict(data.get("selection", {}), source="disk")
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            warnings.warn(f"kernels: ignoring bad selection cache entry {path}: {e}", stacklevel=3)
            return None

    def put(self, key: str, selection: Selection) -> None:
        self.write(key, {"selection": selection.to_dict()})
