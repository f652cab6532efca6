"""Dynamic-shape bucket decisions (benchmark mode): one JSON file per dynamic family (hint problems + bucket rule +
environment), beside the selections. A file whose hint winners differ from the current ones (the hints were
re-tuned) is stale and ignored."""
from __future__ import annotations

from kernels.store.entries import KeyedJsonStore

SCHEMA = 1


class BucketStore(KeyedJsonStore):
    subdir = "selections/dynamic"

    def load(self, key: str, winners: list[str]) -> dict[str, dict]:
        data = self.read(key)
        if (data is None or data.get("schema") != SCHEMA or data.get("winners") != winners
                or not isinstance(data.get("buckets"), dict)):
            return {}
        return {b: e for b, e in data["buckets"].items() if isinstance(e, dict) and isinstance(e.get("winner"), str)}

    def record(self, key: str, winners: list[str], bucket: str, entry: dict) -> None:
        """Merge one bucket's decision into the file (call under lock(key))."""
        buckets = self.load(key, winners)
        buckets[bucket] = entry
        self.write(key, {"schema": SCHEMA, "winners": winners, "buckets": buckets})
