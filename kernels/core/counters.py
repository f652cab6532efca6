"""Process-wide counters: what tuning and dispatch did since the process started."""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass


@dataclass
class Stats:
    compiles: int = 0            # kernels actually compiled (not loaded from the artifact store)
    artifact_loads: int = 0      # kernels loaded from the artifact store without compiling
    benchmarks: int = 0          # candidates timed
    tunes: int = 0               # problems tuned in this process
    memory_hits: int = 0         # calls served by the in-memory dispatch table... counted on first use per problem
    disk_hits: int = 0           # problems whose selection came from the persistent store
    cpu_fallbacks: int = 0       # problems computed with torch on CPU tensors (no interpreter)
    bucket_benchmarks: int = 0   # dynamic shapes: buckets whose hint winners were benchmarked at runtime
    bucket_disk_hits: int = 0    # dynamic shapes: bucket decisions read from the persistent store


_stats = Stats()
_lock = threading.Lock()


def bump(field: str, by: int = 1) -> None:
    with _lock:
        setattr(_stats, field, getattr(_stats, field) + by)


def snapshot() -> dict[str, int]:
    with _lock:
        return asdict(_stats)


def reset() -> None:
    global _stats
    with _lock:
        _stats = Stats()
