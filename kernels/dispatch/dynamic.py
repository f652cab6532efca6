"""Dynamic shapes: one tuned winner per size hint, and runtime dispatch of every new shape among those winners.

    kernels.mm(a, b, dynamic="m")                                   # M dynamic, the default hints, mode, buckets
    kernels.mm(a, b, dynamic=kernels.Dynamic("m", hints=(64, 256, 4096), mode="similarity"))

For a dynamic problem the dynamic dims are replaced by each hint (the cartesian product when several dims are
dynamic) and each hint problem goes through the normal tune + selection store
(`kernels.dispatch.selected.launcher_for`). The hint problems and the runtime problems carry `GemmProblem.dynamic`, so the backends build binaries that do not
specialise on those dims: a winner tuned at M=64 is the same binary at M=300, loaded, never compiled.

A runtime shape is served by a candidate the hint tunes timed, chosen by
- `benchmark` mode: the first shape seen in a bucket (powers of two by default, `BucketRule`) benchmarks each
  hint's winner and runners-up (`Dynamic.pool` per hint, DYNAMIC_POOL by default) on that shape (verified first,
  timed with kernels.timing); the best serves the whole bucket. A size between two hints is often served best by neither
  winner. Decisions are persisted next to the selections (`BucketStore`), so a new process does not benchmark again.
- `similarity` mode: no runtime benchmark; the winner of the hint whose shapes are nearest by L1 distance in log2
  space over A, B and C (`dynamic_rules.log2_distance`), with two guards against extrapolating a fixed tile.
The api then puts the exact shape's launcher in its warm dispatch table: steady state costs what a static call costs.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import time

from backends import get_backend
from kernels.core import counters
from kernels.core.choice import Choice, GemmConfig
from kernels.core.config import config
from kernels.core.dynamic_spec import BucketRule
from kernels.core.errors import KernelsError
from kernels.core.fsutil import load_or_build
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection
from kernels.dispatch import selected
from kernels.dispatch.dynamic_records import (  # noqa: F401 - resolve: this module is the api's dynamic entry
    DYNAMIC_POOL,
    Decision,
    Dynamic,
    HintWinner,
    PoolEntry,
    resolve,
    shape_of,
    sizes_label,
    substitute,
)
from kernels.measure.timing import user_call
from kernels.measure.verify import checked_inputs, fresh_timing_sets, verify_launch
from kernels.space.dynamic_rules import (
    bucket_id,
    nearest,
    outside_hints,
    probe_sizes,
    round_inflation,
    waves,
    worst_ratio,
)
from kernels.space.families import TEMPLATE_OPS, complexity
from kernels.space.heuristics import supports
from kernels.space.perf_model import gpu_spec
from kernels.store.buckets import BucketStore
from kernels.tune.autotune import fingerprint
from kernels.tune.final_round import select

# Benchmark mode: milliseconds of measurement per candidate when a new bucket is benchmarked: a quarter of tuning's
# default budget, because it is paid on a user's call at run time, once per bucket. It sizes the first pass only: a
# probe whose calls take 0.1 ms or more still ends in the steady duel, 2-3.3 s (kernels.measure.steady.WINDOW_MS)
DYNAMIC_BENCH_MS = 10.0
# Benchmark mode: where a new bucket is timed (Family.benchmark's `probes`)
BUCKET_PROBES = ("edges", "one")


class Family:
    """Every runtime problem that shares the static part and the declaration: the hint winners and, in benchmark
    mode, the per-bucket decisions."""

    def __init__(self, problem: GemmProblem, dyn: Dynamic):
        self.dims = dyn.dims
        self.rule = BucketRule(dyn.buckets)
        per_dim = dict(dyn.hints)
        self.points = [dict(zip(self.dims, p)) for p in itertools.product(*(per_dim[d] for d in self.dims))]
        self.hint_problems = [substitute(problem, s, self.dims) for s in self.points]
        self.winners: list[HintWinner] | None = None
        self.notes: list[str] = []
        self.buckets: dict[str, dict] = {}        # benchmark mode, decided in this process or read from disk
        self.store = BucketStore()

    def ensure_winners(self, select) -> list[HintWinner]:
        """`select(problem) -> Selection` tunes (or loads) each hint problem; a hint that cannot be tuned is
        skipped with a note."""
        if self.winners is None:
            winners = []
            for sizes, hp in zip(self.points, self.hint_problems):
                try:
                    winners.append(HintWinner(sizes, hp, select(hp)))
                except KernelsError as e:
                    self.notes.append(f"hint {sizes_label(sizes)} skipped: {str(e).splitlines()[0]}")
            if not winners:
                raise KernelsError(f"kernels.dispatch.dynamic: no size hint could be tuned: {'; '.join(self.notes)}")
            self.winners = winners
        return self.winners

    def store_key(self, backends: tuple[str, ...]) -> str:
        return json.dumps({"hints": [hp.key() for hp in self.hint_problems], "buckets": self.rule.text,
                           "env": fingerprint(backends)}, sort_keys=True)

    def can_run(self, runtime: GemmProblem, c: Choice) -> str:
        """Why a tuned choice cannot run the runtime problem (config limits, e.g. 32-bit offsets), or ''."""
        if c.template in TEMPLATE_OPS and isinstance(c.config, GemmConfig):    # the templates supports() knows
            return supports(runtime, c.template, c.config)[1]
        if c.backend == "aten":               # aten's own limits, e.g. torch._int_mm needs M > 16 on CUDA
            return get_backend("aten").choices(runtime)[1].get(c.name, "")
        return ""

    def ranked_names(self, hw: HintWinner, per_hint: int) -> list[str]:
        """A hint's winner, then its fastest other timed candidates: `per_hint` names in all."""
        rest = [n for n, _ in hw.selection.ranked() if n != hw.choice.name]
        return [hw.choice.name, *rest][:per_hint]

    def pool(self, runtime: GemmProblem, per_hint: int) -> tuple[list[PoolEntry], list[str]]:
        """What may serve the runtime problem: each hint's winner and (per_hint > 1) its runners-up, those that
        can run it. A choice several hints rank appears once per hint."""
        entries, notes = [], []
        for hw in self.winners:
            for rank, name in enumerate(self.ranked_names(hw, per_hint), 1):
                c = hw.selection.choices[name]
                why = self.can_run(runtime, c)
                if why:
                    if rank == 1:
                        notes.append(f"hint {hw.label} winner {c.name} cannot run this shape: {why}")
                    continue
                entries.append(PoolEntry(c, hw, rank))
        return entries, notes

    def pool_names(self, per_hint: int) -> list[str]:
        """Every name the benchmark pool can hold (whatever the runtime shape): the bucket store's staleness key."""
        return list(dict.fromkeys(n for hw in self.winners for n in self.ranked_names(hw, per_hint)))

    @staticmethod
    def labels(name: str, entries: list[PoolEntry]) -> str:
        return " / ".join(e.label for e in entries if e.choice.name == name)

    # -- the two modes -----------------------------------------------------------------------------------------
    def similarity(self, runtime: GemmProblem, entries: list[PoolEntry]) -> tuple[Decision, list[str]]:
        usable = [e.hint for e in entries if e.rank == 1]
        sizes = {d: getattr(runtime, d) for d in self.dims}
        best, dists = nearest(shape_of(runtime), [shape_of(hw.problem) for hw in usable])
        order = sorted(range(len(usable)), key=lambda i: (round(dists[i], 9), -_volume(usable[i].problem)))
        notes = []
        # A tile tuned at a smaller hint whose grid takes more rounds over the SMs here is past a step (H100,
        # K=11008, N=4096: the M=64 hint's 64x32 tile, 128 programs at M=64, 256 at M=74, ran M=74 and 110 at
        # 1.5-1.6x a per-M tune; a 64x64 tile, 64 programs at M=64 and 128 up to M=128, ran them at 1.00x): the
        # nearest hint above serves instead.
        grows = _grid_growth(usable[best].choice, runtime, usable[best].problem)
        above = [i for i in order if all(usable[i].sizes[d] >= sizes[d] for d in grows)]
        if grows and above:
            notes.append(f"{usable[best].choice.name} (hint {usable[best].label}) needs more rounds of programs "
                         f"here than at its hint (growing {','.join(grows)}): served by hint {usable[above[0]].label}")
            best = above[0]
            order = [best] + [i for i in order if i != best]
        # A tile tuned on a compute-bound hint keeps its hint's speed per unit of work only while its last round over
        # the SMs stays as full (H100, K=11008, N=4096: the M=4096 hint's 128x256 TMA tile, 512 programs in 4 full
        # rounds, ran M=1106 (144 programs: 2 rounds, the second nearly empty) at 1.84x a per-M tune, M=2261 at
        # 1.39x, M=3473 at 1.15x; the inflation below predicted 1.85, 1.36, 1.18): the nearest hint whose winner
        # stays within ROUND_INFLATION_SLACK serves instead.
        inflation = [_round_inflation(hw.choice, runtime, hw.problem) for hw in usable]
        if inflation[best] > 1 + ROUND_INFLATION_SLACK:
            fuller = [i for i in order if i != best and inflation[i] <= 1 + ROUND_INFLATION_SLACK]
            if fuller:
                notes.append(f"{usable[best].choice.name} (hint {usable[best].label}) would run its last round over "
                             f"the SMs part-empty here ({inflation[best]:.2f}x the rounds per unit of work at its "
                             f"hint): served by hint {usable[fuller[0]].label}")
                best = fuller[0]
                order = [best] + [i for i in order if i != best]
        # Outside the hints, a fixed tile is extrapolated; an aten winner is not (cuBLAS picks its kernel per call).
        # On the H200, (K, N) = (11008, 4096): M = 1..31 served by the M=64 hint's 64-row Triton tile ran up to
        # 2.4x a per-M tune, served by the aten winner of M=4096 at most 1.12x.
        aten = [i for i in order if usable[i].choice.backend == "aten"]
        outside = outside_hints(sizes, [hw.sizes for hw in usable])
        # (Keeping a 16-row tile below the smallest hint, with nothing smaller to tune, was tried: the M=16 hint's
        # split-K ran M=1..7 at 0.99-1.02x, but when a 16x32 tile won that hint it ran M=1 at 1.47x. Aten is no sure
        # thing there either: 1.04-1.14x in one H100 sweep, up to 1.72x in another. So the default hints start at 2,
        # and this rule only fires for M below half of a user's smallest hint.)
        if aten and usable[best].choice.backend != "aten" and outside:
            notes.append(f"outside the hints: served by hint {usable[aten[0]].label}'s aten winner instead of the "
                         f"nearest hint {usable[best].label}'s {usable[best].choice.name} (cuBLAS picks per call)")
            best = aten[0]
            order = [best] + [i for i in order if i != best]
        ranking = list(dict.fromkeys(usable[i].choice.name for i in order))
        served = next(e for e in entries if e.rank == 1 and e.hint is usable[best])
        if served.choice.backend == "aten" and not outside:
            tile, why = self.tile_for_aten(runtime, served, entries)
            if tile is not None:
                notes.append(why)
                served = tile
                ranking = [tile.choice.name, *ranking]
        dec = Decision("similarity", shape_of(runtime), self.dims, served.choice.name, served.label,
                       "similarity", distances={hw.label: d for hw, d in zip(usable, dists)}, notes=notes)
        return dec, ranking

    @staticmethod
    def tile_for_aten(runtime: GemmProblem, aten: PoolEntry,
                      entries: list[PoolEntry]) -> tuple[PoolEntry | None, str]:
        """(the tile to serve instead of a hint's aten winner away from its hint, and why) or (None, '').
        cuBLAS picks its kernel per shape, so aten's time at its hint does not carry to other sizes (H100, K=11008,
        N=4096: aten won the M=256 hint, then ran M=229 at 1.21x and M=199 at 1.12x a per-M tune,
        where that hint's 64x128 runner-up ran 1.00x); a tile's time follows its work and rounds. So the hint's
        fastest runner-up tile serves when it tied aten at the hint (ATEN_TILE_TOLERANCE) and here takes no more
        rounds over the SMs than at the hint. Memory-bound shapes only: on compute-bound ones cuBLAS held its time
        and the tile did not (H100, K=4096, N=12288: the M=4096 hint's TMA runner-up, 1% faster than aten there,
        ran M=3473 at 1.15x and M=959 (hint 1024) at 1.10x a per-M tune, where aten ran 1.00-1.02x)."""
        hw = aten.hint
        if all(getattr(runtime, d) == v for d, v in hw.sizes.items()) or _compute_bound(runtime) \
                or _compute_bound(hw.problem):
            return None, ""
        aten_ms = hw.selection.timings.get(aten.choice.name)
        if not isinstance(aten_ms, float):
            return None, ""
        runners_up = [e for e in entries if e.hint is hw and e.rank > 1 and isinstance(e.choice.config, GemmConfig)]
        for e in sorted(runners_up, key=lambda e: e.rank):
            ms = hw.selection.timings.get(e.choice.name)
            if not (isinstance(ms, float) and ms <= aten_ms * (1 + ATEN_TILE_TOLERANCE)):
                continue
            if _grid_growth(e.choice, runtime, hw.problem):       # (memory-bound: no part-empty round to weigh)
                continue
            return e, (f"hint {hw.label}'s winner is aten, whose kernel cuBLAS picks per shape: served by its "
                       f"runner-up {e.choice.name} ({ms * 1e3:.1f} vs {aten_ms * 1e3:.1f} us at the hint), a tile "
                       f"that takes no more rounds over the SMs here")
        return None, ""

    def benchmark(self, runtime: GemmProblem, entries: list[PoolEntry], *, per_hint: int = DYNAMIC_POOL,
                  probes: str = "edges") -> tuple[Decision, list[str]]:
        """The bucket's decision: from this process, from the store, or benchmarked now over `entries` (the pool of
        `per_hint` names per hint). `probes`: where a new bucket is timed, "edges" (the runtime size and the
        bucket's first and last size, ranked by the worst ratio to the fastest) or "one" (the runtime size only)."""
        if probes not in BUCKET_PROBES:
            raise ValueError(f"probes must be one of {BUCKET_PROBES}, got {probes!r}")
        bid = bucket_id(self.rule, {d: getattr(runtime, d) for d in self.dims})
        names = list(dict.fromkeys(e.choice.name for e in entries))
        by_name = {e.choice.name: e.choice for e in entries}
        pool = self.pool_names(per_hint)

        def decided(entry: dict, source: str) -> tuple[Decision, list[str]] | None:
            if entry["winner"] not in by_name:
                return None
            timings = entry.get("timings", {})
            winner, notes = entry["winner"], []
            probes = _bucket_probes(runtime, entry)
            if probes:
                winner, note = inflation_guard(winner, runtime, probes, by_name,
                                               frozenset(e.choice.name for e in entries if e.rank == 1))
                notes += [note] if note else []
            ranking = [winner] + sorted((n for n in names if n != winner), key=lambda n: _ms(timings.get(n)))
            at = entry.get("measured_at")
            return Decision("benchmark", shape_of(runtime), self.dims, winner, self.labels(winner, entries), source,
                            bucket=bid, measured_at=tuple(at) if at else None, timings=dict(timings),
                            also_measured=list(entry.get("edge_timings", {})),
                            worst_ratio=dict(entry.get("worst_ratio", {})),
                            seconds=float(entry.get("seconds", 0.0)) if source == "benchmarked" else 0.0,
                            notes=notes), ranking

        if len(names) == 1:
            return Decision("benchmark", shape_of(runtime), self.dims, names[0], self.labels(names[0], entries),
                            "only-candidate", bucket=bid), names
        if bid in self.buckets:
            got = decided(self.buckets[bid], "memory")
            if got is not None:
                return got
        backends = config.backends
        key = self.store_key(backends)

        def load():
            entry = self.store.load(key, pool).get(bid)
            got = decided(entry, "stored") if entry is not None else None
            if got is not None:
                counters.bump("bucket_disk_hits")
                self.buckets[bid] = entry
            return got

        def build():
            start = time.perf_counter()
            timings = benchmark_choices(runtime, [by_name[n] for n in names])
            timed = {n: t for n, t in timings.items() if isinstance(t, float)}
            if not timed:
                raise KernelsError(f"kernels.dispatch.dynamic: no hint candidate ran {runtime.short()}: {timings}")
            edges = probe_sizes(self.rule, {d: getattr(runtime, d) for d in self.dims})[1:] \
                if probes == "edges" else []
            at_edges = {}
            for sizes in edges:
                edge = substitute(runtime, sizes, runtime.dynamic)
                at_edges["x".join(map(str, shape_of(edge)))] = benchmark_choices(edge, [by_name[n] for n in timed])
            scores = worst_ratio([timed, *at_edges.values()])
            winner = pick(scores or timed, by_name, frozenset(e.choice.name for e in entries if e.rank == 1),
                          BUCKET_TIE_TOLERANCE if _compute_bound(runtime) else config.tie_tolerance)
            entry = {"winner": winner, "timings": timings, "measured_at": list(shape_of(runtime)),
                     "edge_timings": at_edges, "worst_ratio": scores,
                     "seconds": time.perf_counter() - start, "created": time.time()}
            self.store.record(key, pool, bid, entry)
            self.buckets[bid] = entry
            counters.bump("bucket_benchmarks")
            return decided(entry, "benchmarked")

        return load_or_build(load, lambda: self.store.lock(key), build)


def _grid_growth(choice: Choice, runtime: GemmProblem, hint: GemmProblem) -> list[str]:
    """The dynamic dims (m, n) past which this choice's grid takes more rounds over the SMs at the runtime shape
    than at the hint shape it was tuned on; [] for choices without a tile (aten) or that are not past a step."""
    cfg = choice.config
    if not isinstance(cfg, GemmConfig):
        return []
    split = int(dict(choice.params).get("split", 1))
    sms = gpu_spec(runtime.arch, runtime.device_name).sms
    grown = waves(runtime.m, runtime.n, cfg.block_m, cfg.block_n, split, sms) > \
        waves(hint.m, hint.n, cfg.block_m, cfg.block_n, split, sms)
    return [d for d in runtime.dynamic if d in ("m", "n") and grown and getattr(runtime, d) > getattr(hint, d)]


ROUND_INFLATION_SLACK = 0.10
# similarity mode: how much slower than a hint's aten winner its runner-up tile may have been at the hint and still
# serve other sizes in aten's place (Family.tile_for_aten)
ATEN_TILE_TOLERANCE = 0.05
# benchmark mode: at a size the bucket was timed at, its winner (ranked by its worst ratio over the timed sizes) gives
# way where another choice ran more than this much faster right there (inflation_guard). Between timed sizes, where
# times are predicted, the slack is ROUND_INFLATION_SLACK: at 5% the predictions moved H100 shapes near the ridge
# from aten to tiles that ran 1.07-1.12x (K=11008, N=4096, M=265; K=4096, N=12288, M=3010, 4007)
BUCKET_MEASURED_SLACK = 0.05


def _compute_bound(p: GemmProblem) -> bool:
    """Past the roofline's ridge: the ideal tensor-core time exceeds the ideal memory time."""
    spec = gpu_spec(p.arch, p.device_name)
    peak = spec.tflops.get(p.dtype, spec.tflops["bf16"]) * 1e12
    return 2 * p.m * p.n * p.k / peak >= p.min_bytes / (spec.hbm_tbs * 1e12)


def _round_inflation(choice: Choice, runtime: GemmProblem, hint: GemmProblem) -> float:
    """dynamic_rules.round_inflation for a tiled choice when both shapes are compute-bound; 1.0 otherwise (aten
    picks its kernel per call; a memory-bound tile's time follows the bytes it reads, not its rounds)."""
    cfg = choice.config
    if not isinstance(cfg, GemmConfig) or not (_compute_bound(runtime) and _compute_bound(hint)):
        return 1.0
    split = int(dict(choice.params).get("split", 1))
    return round_inflation((runtime.m, runtime.n), (hint.m, hint.n), cfg.block_m, cfg.block_n, split,
                           gpu_spec(runtime.arch, runtime.device_name).sms)


def _volume(p: GemmProblem) -> int:
    return p.m * p.n * p.k


def _bucket_probes(runtime: GemmProblem, entry: dict) -> list[tuple[GemmProblem, dict]]:
    """The shapes a bucket decision was timed at (runtime size, then edges), as problems, with their timings."""
    probes = []
    shapes = [(entry.get("measured_at"), entry.get("timings", {}))]
    shapes += [(text.split("x"), t) for text, t in entry.get("edge_timings", {}).items()]
    for shape, timings in shapes:
        if not shape or len(shape) != 3:
            continue
        m, n, k = (int(v) for v in shape)
        probes.append((substitute(runtime, {"m": m, "n": n, "k": k}, runtime.dynamic), timings))
    return probes


def _rounds(choice: Choice, p: GemmProblem) -> int | None:
    """Rounds of a tiled choice's grid over the SMs at this shape; None for choices without a tile (aten)."""
    cfg = choice.config
    if not isinstance(cfg, GemmConfig):
        return None
    split = int(dict(choice.params).get("split", 1))
    return waves(p.m, p.n, cfg.block_m, cfg.block_n, split, gpu_spec(p.arch, p.device_name).sms)


def predicted_ms(choice: Choice, runtime: GemmProblem, probes: list[tuple[GemmProblem, dict]]) -> float | None:
    """The choice's time at a compute-bound runtime shape from a bucket's timings at its probe sizes: a tile's time
    follows its rounds over the SMs, so it is read off the probe with the nearest round count (then the nearest
    size) and scaled by rounds; aten's (cuBLAS picks its kernel per call) off the nearest size, scaled by work (H100:
    the median over the probes, scaled by work, over-predicted aten near the ridge, where time follows bytes more
    than work, and handed M=469 at K=11008, N=4096 to a tile that ran 1.39x). A probe at the runtime shape itself
    gives its measured time. None when the choice was not timed at a compute-bound probe."""
    timed = [(p, t[choice.name]) for p, t in probes if isinstance(t.get(choice.name), float) and _compute_bound(p)]
    if not timed:
        return None
    here = [ms for p, ms in timed if shape_of(p) == shape_of(runtime)]
    if here:                    # timed at this very shape: the measurement, not a prediction
        return here[0]
    rounds = _rounds(choice, runtime)

    def distance(item):
        p = item[0]
        size = abs(math.log(_volume(p) / _volume(runtime)))
        return (abs(_rounds(choice, p) - rounds), size) if rounds is not None else (0, size)

    p, ms = min(timed, key=distance)
    return ms * _volume(runtime) / _volume(p) * _round_inflation(choice, runtime, p)


def inflation_guard(winner: str, runtime: GemmProblem, probes: list[tuple[GemmProblem, dict]],
                    choices: dict[str, Choice], hint_winners: frozenset[str]) -> tuple[str, str]:
    """(choice to serve this exact shape, note or ''). A bucket decision was timed at a few of its sizes; between
    them a compute-bound tile's time steps with its rounds over the SMs (H100, K=4096, N=12288: the 128x256 TMA tile
    won the (512, 1024] bucket timed at M=513 and 1024, 2 and 3 rounds, then ran M=720 at 1.34x and M=831 at 1.23x
    a per-M tune: 3 rounds like M=1024 for 70-80% of its work). Every choice gets a predicted time here
    (predicted_ms); when the winner's exceeds the best by more than ROUND_INFLATION_SLACK (BUCKET_MEASURED_SLACK
    at a timed size), the pick among the predictions serves instead. The bucket's winner is ranked by its worst
    ratio over the timed sizes, so at the timed sizes themselves this hands each its measured best. Memory-bound
    shapes keep the bucket's winner (rounds do not set their time)."""
    if not _compute_bound(runtime):
        return winner, ""
    predicted = {n: t for n, c in choices.items() if (t := predicted_ms(c, runtime, probes)) is not None}
    measured_here = any(shape_of(p) == shape_of(runtime) for p, _ in probes)
    slack = BUCKET_MEASURED_SLACK if measured_here else ROUND_INFLATION_SLACK
    if winner not in predicted or predicted[winner] <= min(predicted.values()) * (1 + slack):
        return winner, ""
    instead = pick(predicted, choices, hint_winners)
    ratio = predicted[winner] / predicted[instead]
    if measured_here:
        return instead, (f"{winner} won the bucket on its worst ratio over the timed sizes but ran {ratio:.2f}x "
                         f"{instead} at this very shape: served by {instead}")
    why = "would run its last round over the SMs part-empty here" if _rounds(choices[winner], runtime) is not None \
        else "is predicted slower here"
    return instead, (f"{winner} {why} (predicted {ratio:.2f}x {instead} from the bucket's timings): "
                     f"served by {instead}")


def _ms(t) -> float:
    return t if isinstance(t, float) else float("inf")


# A bucket decision serves every size in the bucket, timed at one of them: a compute-bound tile's time steps inside
# the bucket as its grid crosses rounds over the SMs, while aten picks its kernel per call. On the H100, K=11008,
# N=4096: a TMA 128x256 tile that tied aten at M=3010 served M=2261 at 1.38x. So in compute-bound buckets, within
# this tolerance the simpler choice wins, then a hint's winner before its runners-up. Memory-bound buckets (small M)
# take only the tuning tie tolerance: there a tile's time is smooth in M and cuBLAS's is not (aten won the (2, 4]
# bucket on this rule at 1.04x split-K's worst ratio, then ran M=4 at 1.15x a per-M tune).
BUCKET_TIE_TOLERANCE = 0.05


def pick(timed: dict[str, float], choices: dict[str, Choice], winners: frozenset[str] = frozenset(),
         tolerance: float = BUCKET_TIE_TOLERANCE) -> str:
    """Fastest, except that within `tolerance` (at least the tuning tie tolerance) the simpler choice wins, then
    one of the hint `winners`."""
    best = min(timed.values())
    tolerance = max(tolerance, config.tie_tolerance)
    tied = [n for n, t in timed.items() if t <= best * (1 + tolerance)]
    return min(tied, key=lambda n: (complexity(choices[n]), n not in winners, timed[n]))


def benchmark_choices(problem: GemmProblem, choices: list[Choice]) -> dict[str, float | str]:
    """Build each choice for this exact problem (loads, no compile) and select among them as tuning does
    (kernels.tune.final_round.select), each finalist checked against the float64 reference on fresh inputs first.
    name -> median ms, or failure text."""
    device = "cuda" if problem.device == "cuda" else "cpu"
    results: dict[str, float | str] = {}
    launches = {}
    by_name = {c.name: c for c in choices}
    for c in choices:
        launch, err = build_launch(problem, c)
        if launch is None:
            results[c.name] = err
        else:
            launches[c.name] = launch
    if launches:
        seed = int(time.time_ns() % (1 << 30))
        operands, ref = checked_inputs(problem, device, seed)
        sets = fresh_timing_sets(problem, device, seed + 1)
        # the selection routine tuning uses (kernels.tune.final_round): an interleaved first pass, then the
        # finalists and the baseline in the final round of the call's regime. Interleaved with choices several times
        # slower (a small hint's tile at a large M), a compute-bound tile was timed faster than it runs beside its
        # real rivals: H100, K=11008, N=4096, M=5334, the 128x256 TMA tile took 725 us in the bucket's benchmark
        # beside 4.4 ms split-K tiles and 815 us in the sweep beside aten, and won a bucket it then served at 1.12x.
        # a hint winner that fails verification here is one failed candidate; only those that may be finalists
        # are verified (kernels.tune.final_round.OnDemandCheck)
        outcome = select({n: user_call(fn, sets) for n, fn in launches.items()}, by_name, len(sets), device,
                         DYNAMIC_BENCH_MS, verify=lambda name: verify_launch(launches[name], problem, operands, ref))
        finalists = set(outcome.finalists)
        for name, t in outcome.timings.items():
            # only the final round's times compare with each other: a first pass is a burst, and in the steady
            # regime a burst flatters a tile that the power cap then slows (kernels.measure.steady)
            results[name] = t if name in finalists or not isinstance(t, float) else \
                f"not a finalist (first pass {t * 1e3:.1f} us)"
    return results


def build_launch(problem: GemmProblem, choice: Choice):
    """(launch, None) or (None, why). The binary is the hint winner's: same spec, so it is loaded, not compiled."""
    try:
        outcome = get_backend(choice.backend).build(problem, [choice])[0]
    except Exception as e:  # noqa: BLE001
        return None, f"build failed: {type(e).__name__}: {str(e)[:300]}"
    if outcome.runner is None:
        return None, outcome.error or "build failed"
    return outcome.runner.launch, None


# -- process state ---------------------------------------------------------------------------------------------
_families: dict[tuple, Family] = {}
_decisions: dict[tuple, Decision] = {}
_runtime: dict[tuple, object] = {}


def family_for(problem: GemmProblem, dyn: Dynamic) -> Family:
    fam = Family(problem, dyn)
    key = (tuple(fam.hint_problems), fam.rule.text)
    return _families.setdefault(key, fam)


def launcher_for(problem: GemmProblem, dyn: Dynamic):
    """The launcher serving this runtime problem under `dyn` (resolved), deciding (and remembering) which hint
    winner serves it. Called by the api's cold path under its lock."""
    runtime = dataclasses.replace(problem, dynamic=dyn.dims)
    memo = (runtime, dyn)
    with selected.lock:
        launch = _runtime.get(memo)
        if launch is not None:
            return launch
        fam = family_for(runtime, dyn)
        fam.ensure_winners(_select)
        entries, notes = fam.pool(runtime, dyn.pool)   # similarity: runners-up for tile_for_aten
        if not any(e.rank == 1 for e in entries):   # no hint winner can run this shape: tune it on its own
            launch = selected.launcher_for(runtime)         # (still dynamic: no new spec)
            sel = selected.selection(runtime)
            dec = Decision(dyn.mode, shape_of(runtime), dyn.dims, sel.winner, "none", "own-tune",
                           hint_winners={hw.label: hw.choice.name for hw in fam.winners}, notes=fam.notes + notes)
            _decisions[memo] = dec
            _runtime[memo] = launch
            return launch
        dec, ranking = fam.similarity(runtime, entries) if dyn.mode == "similarity" else \
            fam.benchmark(runtime, entries, per_hint=dyn.pool)
        dec.hint_winners = {hw.label: hw.choice.name for hw in fam.winners}
        dec.notes = fam.notes + notes + dec.notes
        by_name = {e.choice.name: e.choice for e in entries}
        for name in ranking:
            launch, err = build_launch(runtime, by_name[name])
            if launch is not None:
                err = _checked(runtime, by_name[name], launch)
            if launch is not None and err is None:
                if name != dec.winner:
                    dec.notes.append(f"served by {name} instead: {dec.winner} could not serve this shape")
                    dec.winner, dec.hint = name, fam.labels(name, entries)
                break
            dec.notes.append(f"{name} could not serve this shape: {err}")
        else:
            raise KernelsError(f"kernels.dispatch.dynamic: no hint winner could be built for {runtime.short()}: "
                               f"{'; '.join(dec.notes)}")
        _decisions[memo] = dec
        _runtime[memo] = launch
        return launch


def _select(hint_problem: GemmProblem) -> Selection:
    # tune or load, through the normal selection store, memoised per process; no calls reach a hint problem's
    # launcher, so its tune runs its duel itself
    selected.launcher_for(hint_problem, calls_follow=False)
    return selected.selection(hint_problem)


def decision(problem: GemmProblem, dyn: Dynamic) -> Decision:
    """The decision for this runtime problem (dispatching it first if it was never seen)."""
    launcher_for(problem, dyn)
    return _decisions[(dataclasses.replace(problem, dynamic=dyn.dims), dyn)]


def explain(problem: GemmProblem, dyn: Dynamic) -> Selection:
    """The serving hint winner's Selection, with source 'dynamic-<mode>' and the reason as its first note."""
    dec = decision(problem, dyn)
    runtime = dataclasses.replace(problem, dynamic=dyn.dims)
    fam = family_for(runtime, dyn)
    base = _select(runtime) if dec.source == "own-tune" else \
        next(hw.selection for hw in fam.winners if dec.winner in hw.selection.choices)
    sel = dataclasses.replace(base, winner=dec.winner, source=f"dynamic-{dec.mode}", notes=[dec.why(), *base.notes])
    sel.decision = dec           # the structured form, for programs (bench/dynamic.py)
    return sel


_checked_here: set[tuple] = set()     # (choice, op, dtype, layouts) verified in this process


def _checked(runtime: GemmProblem, choice: Choice, launch) -> str | None:
    """A hint's runner-up or a stored bucket winner came from disk: before it serves, it is checked against the
    float64 reference once per process (per choice, op, dtype and layouts), like a stored static winner."""
    key = (choice.name, runtime.op, runtime.dtype, runtime.layout_a, runtime.layout_b)
    if key in _checked_here:
        return None
    why = selected.verify(launch, runtime)
    if why is None:
        _checked_here.add(key)
    return why


def clear() -> None:
    _checked_here.clear()
    _families.clear()
    _decisions.clear()
    _runtime.clear()


def trim(keep: int) -> None:
    """Keep the decisions and launchers of the `keep` most recently added runtime shapes (families stay: a few per
    model, each holding its hint winners)."""
    with selected.lock:
        for memo in list(_runtime)[:max(0, len(_runtime) - keep)]:
            del _runtime[memo]
            _decisions.pop(memo, None)
