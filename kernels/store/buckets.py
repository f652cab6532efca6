"""Dynamic-shape bucket decisions (benchmark mode): one JSON file per dynamic family (hint problems + bucket rule +
environment), beside the selections. A file whose hint winners differ from the current ones (the hints were
re-tuned) is stale and ignored. Each bucket's entry is data read back from disk: one whose fields are not what
kernels.dispatch.dynamic writes (`entry_problem`) is dropped, a miss, so that bucket is benchmarked again."""
from __future__ import annotations

from kernels.core.problem import MAX_DIM
from kernels.store.entries import KeyedJsonStore
from kernels.store.schema import finite_non_negative, valid_timings

SCHEMA = 1


def _size(v) -> bool:
    """A problem dimension a bucket can be timed at (zero-size problems are never benchmarked)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v < MAX_DIM


def _shape_text(text) -> bool:
    """An edge's key, "MxNxK"."""
    parts = text.split("x") if isinstance(text, str) else []
    return len(parts) == 3 and all(p.isdigit() and p.isascii() and _size(int(p)) for p in parts)


def entry_problem(entry) -> str | None:
    """Why one bucket's decision cannot be used, or None. Never raises. The types are what
    kernels.dispatch.dynamic writes; only "winner" is required (its readers default the rest)."""
    if not isinstance(entry, dict):
        return "not an object"
    if not isinstance(entry.get("winner"), str):
        return "winner is not a name"
    if not valid_timings(entry.get("timings", {})):
        return "timings malformed"
    at = entry.get("measured_at")
    if at is not None and not (isinstance(at, list) and len(at) == 3 and all(_size(v) for v in at)):
        return "measured_at is not a shape"
    edges = entry.get("edge_timings", {})
    if not (isinstance(edges, dict) and all(_shape_text(s) and valid_timings(t) for s, t in edges.items())):
        return "edge_timings malformed"
    ratios = entry.get("worst_ratio", {})
    if not (isinstance(ratios, dict) and all(finite_non_negative(v) for v in ratios.values())):
        return "worst_ratio malformed"
    for key in ("seconds", "created"):
        if not finite_non_negative(entry.get(key, 0.0)):
            return f"{key} is not a time"
    return None


def bad_buckets(data: dict) -> list[str]:
    """What is wrong with the buckets of a decisions file, one line per bucket (for `cache verify`)."""
    buckets = data.get("buckets")
    if not isinstance(buckets, dict):
        return ["buckets is not an object"]
    return [f"bucket {b!r}: {why}" for b, e in buckets.items() if (why := entry_problem(e)) is not None]


class BucketStore(KeyedJsonStore):
    subdir = "selections/dynamic"
    held_for = "benchmarking the same dynamic buckets"

    def load(self, key: str, winners: list[str]) -> dict[str, dict]:
        data = self.read(key)
        if (data is None or data.get("schema") != SCHEMA or data.get("winners") != winners
                or not isinstance(data.get("buckets"), dict)):
            return {}
        return {b: e for b, e in data["buckets"].items() if entry_problem(e) is None}

    def record(self, key: str, winners: list[str], bucket: str, entry: dict) -> None:
        """Merge one bucket's decision into the file (call under lock(key))."""
        buckets = self.load(key, winners)
        buckets[bucket] = entry
        self.write(key, {"schema": SCHEMA, "winners": winners, "buckets": buckets})
