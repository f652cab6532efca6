"""Process-wide counters: what tuning and dispatch did since the process started.

Pass-throughs (calls `kernels.enabled()` or a patched nn.Linear handed to torch unchanged because the library does
not serve them) are counted in total (`passthroughs`) and per reason: the snapshot carries one
`"passthrough:<reason>"` entry per reason seen (e.g. "passthrough:dtype=float64"), so `kernels.stats()` shows both. kernels.patch's fused blocks that declined after their first-call check are
counted the same way (`fused_declined`, `"fused_declined:<block>:<why>"`)."""
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
    torch_autograd: int = 0      # grad calls' layers handed to torch's own autograd (kernels' winners saved too little)
    bucket_benchmarks: int = 0   # dynamic shapes: buckets whose hint winners were benchmarked at runtime
    bucket_disk_hits: int = 0    # dynamic shapes: bucket decisions read from the persistent store
    passthroughs: int = 0        # calls routed to kernels but handed to torch unchanged (reasons: passthrough:*)
    store_hits: int = 0          # problems whose selection came from the shared store (KERNELS_STORE)
    store_publishes: int = 0     # selections this process published to the shared store
    store_waits: int = 0         # lookups that waited for another machine's tune of the same problem
    store_errors: int = 0        # shared store operations that failed (the lookup went on locally)
    call_duels: int = 0          # duels decided on the caller's calls (KERNELS_DUEL=calls)
    fused_blocks: int = 0        # kernels.patch's fused blocks (RMSNorm, gated MLP) whose first-call check passed
    fused_declined: int = 0      # ... whose check failed: their own forward serves (reasons: fused_declined:*)


PASSTHROUGH_PREFIX = "passthrough:"
FUSED_DECLINED_PREFIX = "fused_declined:"

_stats = Stats()
_reasons: dict[str, int] = {}      # pass-through reason -> calls
_declined: dict[str, int] = {}     # "<block>:<why>" -> fused blocks declined
_lock = threading.Lock()


def bump(field: str, by: int = 1) -> None:
    with _lock:
        setattr(_stats, field, getattr(_stats, field) + by)


def passthrough(reason: str) -> None:
    """One call handed to torch unchanged, and why (a short stable slug: "dtype=float64", "layout=sparse_coo")."""
    with _lock:
        _stats.passthroughs += 1
        _reasons[reason] = _reasons.get(reason, 0) + 1


def fused_declined(reason: str) -> None:
    """One patched block whose first-call check failed, and why ("rmsnorm:differs")."""
    with _lock:
        _stats.fused_declined += 1
        _declined[reason] = _declined.get(reason, 0) + 1


def snapshot() -> dict[str, int]:
    with _lock:
        snap = asdict(_stats)
        snap.update((PASSTHROUGH_PREFIX + reason, n) for reason, n in sorted(_reasons.items()))
        snap.update((FUSED_DECLINED_PREFIX + reason, n) for reason, n in sorted(_declined.items()))
        return snap


def reset() -> None:
    global _stats
    with _lock:
        _stats = Stats()
        _reasons.clear()
        _declined.clear()
