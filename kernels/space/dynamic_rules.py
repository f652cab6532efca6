"""Pure rules for dynamic shapes: shape buckets, probe sizes, the log2 shape distance and the tile-step guard.

No torch, no kernels state: kernels.dispatch.dynamic dispatches with them (the declarations and their parsers are
kernels/core/dynamic_spec.py).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from kernels.core.dynamic_spec import DIMS, BucketRule
from kernels.space.heuristics import cdiv


def bucket_id(rule: BucketRule, sizes: Mapping[str, int]) -> str:
    """One text id for the bucket of every dynamic dim, e.g. 'm∈(256,512]' or 'm∈(16,32] k∈(512,1024]'."""
    return " ".join(rule.label(d, sizes[d]) for d in DIMS if d in sizes)


def probe_sizes(rule: BucketRule, sizes: Mapping[str, int]) -> list[dict[str, int]]:
    """The sizes a new bucket is benchmarked at: the runtime size, then the bucket's first and last size (each
    dynamic dim at its edge; an unbounded bucket has no last). cuBLAS picks its kernel per shape, so aten's time can
    jump inside a bucket (H100, K=11008, N=4096: 36 us at M=3 and M=5, 45 us at M=4), as a tile's does when its
    grid takes another round over the SMs."""
    probes = [dict(sizes)]
    bounds = {d: rule.bounds(v) for d, v in sizes.items()}
    first = {d: lo + 1 for d, (lo, _) in bounds.items()}
    probes.append(first)
    if all(hi is not None for _, hi in bounds.values()):
        probes.append({d: hi for d, (_, hi) in bounds.items()})
    unique = []
    for p in probes:
        if p not in unique:
            unique.append(p)
    return unique


def worst_ratio(timings_per_probe: list[Mapping[str, float | str]]) -> dict[str, float]:
    """Per choice: the largest ratio to the fastest choice over the probes; a choice that failed or was not timed
    at any probe is left out (it cannot serve the whole bucket)."""
    names = [n for n, t in timings_per_probe[0].items() if isinstance(t, float)]
    names = [n for n in names if all(isinstance(t.get(n), float) for t in timings_per_probe)]
    scores = {}
    for n in names:
        scores[n] = max(t[n] / min(t[x] for x in names) for t in timings_per_probe)
    return scores


def operand_shapes(m: int, n: int, k: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """The shapes the similarity distance compares: A (m, k), B (k, n), C (m, n)."""
    return (m, k), (k, n), (m, n)


def log2_distance(x: tuple[int, int, int], y: tuple[int, int, int]) -> float:
    """L1 distance in log2 space over the input and output shapes of two (m, n, k) problems.
    A dynamic M off by 2x costs 2 (it appears in A and C); K off by 2x costs 2 (A and B)."""
    total = 0.0
    for sx, sy in zip(operand_shapes(*x), operand_shapes(*y)):
        for a, b in zip(sx, sy):
            total += abs(math.log2(max(a, 1)) - math.log2(max(b, 1)))
    return total


def nearest(shape: tuple[int, int, int], candidates: list[tuple[int, int, int]]) -> tuple[int, list[float]]:
    """Index of the candidate nearest to `shape` (ties go to the larger problem: its tiles fill a large runtime
    shape, and a small runtime shape loses less from big tiles than a large one from small tiles), and every
    distance."""
    dists = [log2_distance(shape, c) for c in candidates]
    best = min(range(len(candidates)), key=lambda i: (round(dists[i], 9), -math.prod(candidates[i])))
    return best, dists


def outside_hints(sizes: Mapping[str, int], hint_points: list[Mapping[str, int]], margin: float = 2.0) -> bool:
    """True when some dynamic dim of the runtime shape lies more than `margin` times below the smallest or above the
    largest hint of that dim: every hint winner is then extrapolated, not interpolated. (Just below the smallest
    hint a tile runs the grid it was tuned with: on the H100, M=63 served by the M=64 hint's tile ran 1.00x a
    per-M tune, served by an aten winner 1.17x.)"""
    for dim, size in sizes.items():
        values = [p[dim] for p in hint_points if dim in p]
        if values and not min(values) / margin <= size <= max(values) * margin:
            return True
    return False


def round_inflation(runtime_mn: tuple[int, int], hint_mn: tuple[int, int], block_m: int, block_n: int, split: int,
                    num_sms: int) -> float:
    """Rounds over the SMs per output element at the runtime size, relative to the hint size: what a compute-bound
    tile's time per unit of work grows by when its last round runs part-empty (1.0: as full as at its hint)."""
    (m, n), (hm, hn) = runtime_mn, hint_mn
    ratio = waves(m, n, block_m, block_n, split, num_sms) / waves(hm, hn, block_m, block_n, split, num_sms)
    return ratio * (hm * hn) / (m * n)


def waves(m: int, n: int, block_m: int, block_n: int, split: int, num_sms: int) -> int:
    """How many rounds a tiled kernel's grid takes on `num_sms` SMs (one program per SM at a time). A tile tuned at
    a smaller size whose grid needs more rounds at the runtime size is past a step: its time jumps."""
    return cdiv(cdiv(m, block_m) * cdiv(n, block_n) * split, num_sms)
