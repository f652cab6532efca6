"""choose(): support filter -> narrow (lookup table, name filters, benchmark space: kernels.candidates) -> build (in
parallel, per backend) -> verify -> benchmark -> re-time the best -> Selection.

Knows nothing about toolchains: backends hand back Runners; a failure anywhere is recorded, never raised.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
from importlib import metadata
from typing import TYPE_CHECKING, Callable

import torch

from backends import get_backend
from kernels.core import counters
from kernels.core.config import config
from kernels.core.errors import NoCandidateError
from kernels.core.problem import GemmProblem
from kernels.core.progress import status
from kernels.core.selection import Selection
from kernels.core.version import __version__
from kernels.measure.timing import (
    HOST_SET_MAX_MS,
    LAUNCH_GAP_MS,
    device_time_ms,
    measure_interleaved,
    measure_together,
    user_call,
)
from kernels.measure.verify import make_inputs, reference, timing_sets, verify_launch
from kernels.space.families import complexity, one_launch, template_tree_hash
from kernels.tune.build_queue import request as request_build
from kernels.tune.candidates import fingerprint_extra, narrow

if TYPE_CHECKING:
    from backends.base import Backend, Runner
    from kernels.core.choice import Choice


@functools.lru_cache(maxsize=None)
def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def fingerprint(backends: tuple[str, ...]) -> dict:
    """What a stored selection depends on besides the problem: versions, templates, the backend set."""
    return {"kernels": __version__, "torch": torch.__version__, "triton": _package_version("triton"),
            "templates": _template_hash(), "backends": list(backends), "space": config.search_space,
            **fingerprint_extra()}


@functools.lru_cache(maxsize=1)
def _template_hash() -> str:
    return template_tree_hash()


def _device_of(problem: GemmProblem) -> str:
    return "cuda" if problem.device == "cuda" else "cpu"


def candidates(backend: Backend, problem: GemmProblem) -> tuple[list[Choice], dict[str, str], list[str]]:
    """What tune() builds for this backend: its supported choices narrowed by the lookup table, the name filters and
    the benchmark space (kernels.candidates); also name -> why left out, and the narrowing's notes."""
    cands, skipped = backend.choices(problem, config.search_space)
    narrowed = narrow(problem, backend.name, cands)
    skipped.update(narrowed.skipped)
    return narrowed.kept, skipped, narrowed.notes


class StageClock:
    """Seconds per tuning stage, summed over entries (candidates and build run once per backend); each stage is
    announced to `on_stage` (the progress line)."""

    def __init__(self, on_stage: Callable[[str], None] | None = None):
        self.seconds: dict[str, float] = {}
        self.on_stage = on_stage

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.on_stage is not None:
            self.on_stage(stage)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Tuning makes tens of thousands of short-lived objects (a new shape ranks ~2,700 candidates), each burst a
    chance for a full collection whose cost grows with the caller's heap: 0.1-0.15 s per tune with three million
    objects alive, the time a new shape's whole candidate ranking takes. Reference counting frees what tuning makes;
    cycles wait for the collector to come back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def tune(problem: GemmProblem, backends: tuple[str, ...]) -> tuple[Selection, dict[str, Runner]]:
    """Tune one problem; returns the Selection and the runners that passed verification (for dispatch). A bad
    setting raises kernels.core.errors.SettingError before anything is built."""
    config.validate()
    with _cyclic_gc_paused(), status(f"kernels: tuning {problem.short()}") as update:
        return _tune(problem, backends, lambda stage: update(f"kernels: tuning {problem.short()}: {stage}"))


def _tune(problem: GemmProblem, backends: tuple[str, ...], on_stage: Callable[[str], None] | None = None
          ) -> tuple[Selection, dict[str, Runner]]:
    start = time.perf_counter()
    clock = StageClock(on_stage)
    device = _device_of(problem)
    timings: dict[str, float | str] = {}
    choices = {}
    notes: list[str] = []
    runners: dict[str, Runner] = {}
    unavailable: list[str] = []
    pending: list[str] = []

    for name in backends:
        try:
            backend = get_backend(name)
            ok, why = backend.available(problem)
            if not ok:
                notes.append(f"{name} unavailable: {why}")
                unavailable.append(name)
                continue
            with clock("candidates"):
                cands, skipped, narrow_notes = candidates(backend, problem)
            notes.extend(narrow_notes)
            for cname, why in skipped.items():
                timings[cname] = f"unsupported: {why}"
            for c in cands:
                choices[c.name] = c
            with clock("build"):
                outcomes = backend.build(problem, cands)
            waiting = [o.choice for o in outcomes if o.pending]
            if waiting:     # left to the background build: tuned without them, re-tuned once they are built
                pending += [c.name for c in waiting]
                notes += [n for n in (request_build(problem, waiting),) if n]
            for outcome in outcomes:
                if outcome.runner is None:
                    timings[outcome.choice.name] = outcome.error or "build failed"
                else:
                    runners[outcome.choice.name] = outcome.runner
        except Exception as e:  # noqa: BLE001 - one broken backend must not take tuning down
            notes.append(f"{name} failed: {type(e).__name__}: {e}")

    details: dict[str, dict] = {}
    with clock("isolated"):
        isolated_ok = _measure_isolated(problem, runners, timings, details)

    with clock("verify"):
        a, b = make_inputs(problem, device, seed=int(time.time_ns() % (1 << 31)))
        ref = reference(problem, a, b)
        verified: dict[str, Runner] = {}
        for cname, runner in runners.items():
            if runner.isolated:
                continue
            why = verify_launch(runner.launch, problem, a, b, ref)
            if why is None:
                verified[cname] = runner
            else:
                timings[cname] = why
        del ref

    if verified or isolated_ok:
        with clock("first_pass"):
            sets = timing_sets(problem, device, (a, b), seed=1)
            n_sets = len(sets)
            timed, crashed = measure_interleaved({n: _user_call(r, sets) for n, r in verified.items()}, n_sets,
                                                 device, config.bench_budget_ms, cutoff=TUNE_CUTOFF)
            for cname, why in crashed.items():
                timings[cname] = f"crashed while timing: {why}"
                del verified[cname]
            for cname, t in timed.items():
                counters.bump("benchmarks")
                timings[cname] = t.median_ms
                details[cname] = t.as_dict()
        verified.update(isolated_ok)   # verified and timed in a child; safe to re-time here beside the rest
        winner = _pick_winner(problem, timings, choices, verified, sets, n_sets, device, details, notes, clock)
        del sets
    else:
        winner = None
    if winner is None:
        failures = {n: str(t) for n, t in timings.items()}
        failures.update({f"note {i}": n for i, n in enumerate(notes)})
        raise NoCandidateError(problem.short(), failures)

    sel = Selection(problem=problem, winner=winner, choices=choices, timings=timings, details=details,
                    source="tuned", tune_seconds=time.perf_counter() - start, created=time.time(), notes=notes,
                    stage_seconds={k: round(v, 4) for k, v in clock.seconds.items()}, unavailable=unavailable,
                    pending=pending)
    counters.bump("tunes")
    if config.verbose:
        print(sel.table(), file=sys.stderr)
    return sel, {winner: verified[winner]}


def _measure_isolated(problem, runners, timings, details) -> dict[str, Runner]:
    """Runners whose backend asks for isolation are verified and timed in a child process by that backend."""
    by_backend: dict[str, list[Runner]] = {}
    for runner in runners.values():
        if runner.isolated:
            by_backend.setdefault(runner.choice.backend, []).append(runner)
    passed: dict[str, Runner] = {}
    for name, group in by_backend.items():
        try:
            results = get_backend(name).measure_isolated(problem, group, config.bench_budget_ms)
        except Exception as e:  # noqa: BLE001
            results = {r.choice.name: f"isolated measurement failed: {type(e).__name__}: {e}" for r in group}
        for runner in group:
            res = results.get(runner.choice.name, "no result from isolated measurement")
            if isinstance(res, str):
                timings[runner.choice.name] = res
            else:
                counters.bump("benchmarks")
                timings[runner.choice.name] = res.median_ms
                details[runner.choice.name] = {**res.as_dict(), "measured_in": "child"}
                passed[runner.choice.name] = runner
    return passed


def _user_call(runner: Runner, sets):
    return user_call(runner.launch, sets)


# First pass: a candidate this many times slower than the best so far after a few samples stops being measured (it
# cannot win; the budget goes to the contenders). It must stay above one candidate's first-pass jitter: int8
# 64x64x65536 split-K first-passed at 13.5-16.5 us (1.22x) over three H100 tunes
TUNE_CUTOFF = 1.25
# How many of the first pass's fastest are re-timed side by side (with the baseline; more for calls under
# HOST_BOUND_MAX_MS) before the winner is chosen. 3 since the first version, not measured against other values; each
# one more costs a measurement budget in the final round
RETIME_TOP = 3
# Calls under HOST_BOUND_MAX_MS: finalists whose call times are within this fraction of the best are ranked by GPU time
# (from a CUDA graph) instead, host cost that close being noise between runs. 3%, not more: the pick may then cost up
# to this much per call, and issue 2 allows 3% regret (at 5%, aten won 64x22016x4096 at 1.035x the best call time on
# the H100, GPU times equal). 0 turns the rule off.
HOST_BOUND_TOLERANCE = 0.03


# Calls slower than this are not host-bound on any GPU we know; below it, GPU time is worth measuring (each capture
# holds its outputs, so it is kept off big problems)
HOST_BOUND_MAX_MS = 0.1
# ...and their first-pass times, taken one candidate at a time, are host jitter: for int8 64x64x65536 on the H100 one
# split-K tile's first pass took 16.5, 14.7 and 13.5 us per call in three tunes (10.6 us of GPU time, the fastest);
# at 16.5 it missed the top 3, and in a fast-preset run a tile 1.26x slower side by side won. Below HOST_BOUND_MAX_MS
# every call within TUNE_CUTOFF of the fastest first pass joins the final round (HOST_BOUND_FINALISTS at most),
# where GPU time can rank it.
HOST_BOUND_FINALISTS = 8
# Even interleaved, host-set first passes of one launch path spread wider than TUNE_CUTOFF: bf16 24x6144x1536 on the
# H100 first-passed two triton_mm tiles at 16.1 and 16.7 us and two others at 11.6-11.9 us in one tune, all ~13 us in
# another; the 16.7 us one had the lowest GPU time of the five (9.7 us) and left the running. GPU time is cheap to
# take at this size and is not host jitter: where the fastest first pass is under HOST_SET_MAX_MS, the first pass's
# HOST_BOUND_SCREEN fastest calls within SCREEN_SPREAD of it are GPU-timed and the GPU-fastest RETIME_TOP of them join
# the final round too.
HOST_BOUND_SCREEN = 16
SCREEN_SPREAD = 2.0
# how far below a challenger's 20th percentile the baseline's must be to keep it (_pick_winner says why)
BASELINE_P20_MARGIN = 0.15


# a call this much longer than its GPU time waits on the host (one launch of ours costs LAUNCH_GAP_MS when it does not)
HOST_SET_GAP_MS = 2 * LAUNCH_GAP_MS


def gpu_ranked_contenders(call_ms: dict[str, float], gpu_ms: dict[str, float | None],
                          tolerance: float) -> list[str]:
    """Finalists within `tolerance` of the fastest user-call time, to be ranked by GPU time, when every one of them
    waits on the host (its call HOST_SET_GAP_MS beyond its GPU time); [] otherwise, or when a GPU time is unknown
    (the capture failed). Calls set by the host measure its cost per call, which drifts between runs by more than
    that (torch.mm at 12-25 us per call for one problem on the lent H200, 17.8-29.3 us for one split-K winner in two
    runs on the H100); the GPU time does not, and it is what a caller whose host runs ahead waits for. A call that
    does not wait on the host is its kernel plus the call's own overhead, which the caller pays: bf16 1024x8192x512
    on the H100, aten at 20.9 us per call (16.4 on the GPU) against a Triton tile's 20.4 (18.8), was picked by GPU
    time and then ran 1.12x the tile side by side."""
    best = min(call_ms.values())
    close = [n for n, t in call_ms.items() if t <= best * (1 + tolerance)]
    if len(close) < 2 or any(gpu_ms.get(n) is None or call_ms[n] - gpu_ms[n] <= HOST_SET_GAP_MS for n in close):
        return []
    return close


def one_launch_lead(call_ms: dict[str, float], gpu_ms: dict[str, float | None], launches_once: set[str],
                    cutoff: float, tie: float, complexity: dict[str, int]) -> tuple[str, list[str]] | None:
    """(the lead, the group): among the finalists that are one launch of ours (`launches_once`) and within `cutoff`
    of the fastest call, the one lowest on the GPU (the simplest within `tie` of it); None when fewer than two.

    One launch through the same native launcher costs the host the same whatever the tile, so such a call takes
    about max(host cost, GPU time) plus a launch gap: the GPU time orders the group as their call times would
    without the host's jitter, which at this size spreads one path's calls by more than the tiles differ (bf16 768^3
    on the H100: two triton_mm tiles at 15.2 us per call side by side, 5.5 and 7.7 us on the GPU, and the slower had
    won a final round; bf16 256x256x16384: split_k split32 won by 4% of call time at 14.2 us of GPU time against
    split16's 12.4, and side by side ran 1.01x per call)."""
    best = min(call_ms.values())
    group = [n for n, t in call_ms.items() if n in launches_once and t <= best * cutoff and gpu_ms.get(n) is not None]
    if len(group) < 2:
        return None
    lowest = min(gpu_ms[n] for n in group)
    lead = min((n for n in group if gpu_ms[n] <= lowest * (1 + tie)), key=lambda n: (complexity[n], gpu_ms[n]))
    return lead, group


def _pick_winner(problem, timings, choices, verified, sets, n_sets, device, details, notes,
                 clock: StageClock | None = None, *, retime_top: int = RETIME_TOP, cutoff: float = TUNE_CUTOFF,
                 host_bound_tolerance: float = HOST_BOUND_TOLERANCE) -> str | None:
    """Re-time the fastest few together, then let the simplest win among those within the tie tolerance.

    The baseline (the simplest, aten) is also kept when a challenger beats its median while its 20th percentile is
    BASELINE_P20_MARGIN below the challenger's: interference only ever slows a call, and it does not slow all calls
    alike. On the H100, bf16 3000x2000x1000 ran episodes of 10-30 ms in which torch.mm took 1.3-8x its 23 us (4% of
    its samples, against 0.7% of a Triton tile's, which recovered sooner); one tune's final round measured aten above
    the 36 us of a TMA tile that it beat by 1.35x side by side a moment later. The margin: aten's own spread is wide
    (bf16 1024x8192x512: median 23.0 us, p20 18.9, against a tile's 20.7 / 20.3 that then ran 1.05x faster)."""
    clock = clock or StageClock()
    ranked = sorted((t, n) for n, t in timings.items() if isinstance(t, float))
    if not ranked:
        return None
    top = [n for _, n in ranked[:retime_top]]
    host_bound = device == "cuda" and ranked[0][0] < HOST_BOUND_MAX_MS and host_bound_tolerance > 0
    gpu_ms: dict[str, float | None] = {}
    if host_bound:
        top += [n for t, n in ranked[retime_top:HOST_BOUND_FINALISTS] if t <= ranked[0][0] * cutoff]
    if host_bound and ranked[0][0] < HOST_SET_MAX_MS:
        with clock("gpu_time"):
            gpu_ms = {n: device_time_ms(_user_call(verified[n], sets), n_sets) for t, n in ranked[:HOST_BOUND_SCREEN]
                      if t <= ranked[0][0] * SCREEN_SPREAD}
        by_gpu = sorted((g, timings[n], n) for n, g in gpu_ms.items() if g is not None)
        top += [n for _, _, n in by_gpu[:retime_top] if n not in top]
    # the simplest candidate (aten) always joins the final round: it is the baseline we must not lose to
    simplest = min((n for _, n in ranked), key=lambda n: (complexity(choices[n]), timings[n]))
    if simplest not in top:
        top.append(simplest)
    if len(top) > 1:
        with clock("final_round"):
            final = measure_together({n: _user_call(verified[n], sets) for n in top}, n_sets, device,
                                     config.bench_budget_ms * len(top))
        for n, t in final.items():
            details[n]["first_pass_ms"] = timings[n]
            details[n]["retimed_ms"] = t.median_ms
            timings[n] = t.median_ms
        final_ms = {n: t.median_ms for n, t in final.items()}
        low_ms = {n: t.p20_ms for n, t in final.items()}
    else:
        final_ms, low_ms = {top[0]: timings[top[0]]}, {}
    calls, lows = dict(final_ms), dict(low_ms)
    best = min(final_ms.values())
    if host_bound and len(final_ms) > 1 and best < HOST_BOUND_MAX_MS:
        # finalists not screened (isolated ones, a slow aten) that are close enough to be ranked by it (within
        # the cutoff of the fastest call); capturing aten at 8x the best call cost a new shape 0.15 s (int8
        # 544x4096x11008 on the H100)
        with clock("gpu_time"):
            gpu_ms.update({n: device_time_ms(_user_call(verified[n], sets), n_sets) for n, t in final_ms.items()
                           if n not in gpu_ms and t <= best * max(cutoff, 1 + host_bound_tolerance)})
        for n, g in gpu_ms.items():
            details[n]["gpu_ms"] = g
        simplicity = {n: complexity(choices[n]) for n in final_ms}
        lead = one_launch_lead(final_ms, gpu_ms, {n for n in final_ms if one_launch(choices[n])},
                               cutoff, config.tie_tolerance, simplicity)
        if lead is not None:
            # the group goes on as its lead, at the group's fastest call: the lead runs no slower than any of them
            name, group = lead
            quickest = min(group, key=final_ms.get)
            calls = {n: t for n, t in final_ms.items() if n not in group} | {name: final_ms[quickest]}
            lows = {n: t for n, t in low_ms.items() if n not in group} | {name: min(low_ms.get(n, final_ms[n])
                                                                                    for n in group)}
            if name != quickest:
                notes.append(f"{name} chosen over {quickest}: one-launch calls under {HOST_BOUND_MAX_MS * 1e3:.0f} us "
                             f"ranked by GPU time ({gpu_ms[name] * 1e3:.1f} vs {gpu_ms[quickest] * 1e3:.1f} us; "
                             f"{final_ms[name] * 1e3:.1f} vs {final_ms[quickest] * 1e3:.1f} us per call)")
        # above the host floor a call's time beyond its kernel is the call's own overhead, not the host's pace
        # (bf16 96x22016x4096: aten at 70.1 us per call, 65.6 on the GPU, picked by GPU time over a tile at 68.4,
        # 65.5, then ran 1.045x it side by side)
        close = (gpu_ranked_contenders(calls, gpu_ms, host_bound_tolerance)
                 if min(calls.values()) < HOST_SET_MAX_MS else [])
        if close:
            fastest = min(close, key=calls.get)
            fastest_gpu = min(gpu_ms[n] for n in close)
            tied = [n for n in close if gpu_ms[n] <= fastest_gpu * (1 + config.tie_tolerance)]
            winner = min(tied, key=lambda n: (complexity(choices[n]), gpu_ms[n]))
            if winner != fastest:
                notes.append(f"{winner} chosen over {fastest}: calls under {HOST_BOUND_MAX_MS * 1e3:.0f} us within "
                             f"{host_bound_tolerance:.0%} of each other, ranked by GPU time "
                             f"({gpu_ms[winner] * 1e3:.1f} vs {gpu_ms[fastest] * 1e3:.1f} us)")
            return winner
    fastest = min(calls, key=calls.get)
    best = calls[fastest]
    tied = [n for n, t in calls.items() if t <= best * (1 + config.tie_tolerance)]
    winner = min(tied, key=lambda n: (complexity(choices[n]), calls[n]))
    if winner != fastest:
        notes.append(f"{winner} chosen over faster-by-noise {fastest} (tie tolerance "
                     f"{config.tie_tolerance:.0%})")
    if winner != simplest and simplest in lows and lows[simplest] <= lows[winner] * (1 - BASELINE_P20_MARGIN):
        notes.append(f"{simplest} kept over {winner}: slower by median ({calls[simplest] * 1e3:.1f} vs "
                     f"{calls[winner] * 1e3:.1f} us) but not by its 20th percentile ({lows[simplest] * 1e3:.1f} "
                     f"vs {lows[winner] * 1e3:.1f} us)")
        winner = simplest
    return winner


def prebuild(problems: list[GemmProblem], backends: tuple[str, ...]) -> dict[str, int]:
    """Compile ahead what tune() will build for each of these problems (same choices, same narrowing), one batch
    per backend that batches (`Backend.prebuild`); tune() then loads those binaries. Returns backend -> compiled.
    Best effort: a backend that fails here fails again, with its reason, in tune()."""
    compiled = {}
    for name in backends:
        try:
            backend = get_backend(name)
            work = []
            for problem in problems:
                if backend.available(problem)[0]:
                    work.append((problem, candidates(backend, problem)[0]))
            compiled[name] = backend.prebuild(work)
        except Exception:  # noqa: BLE001 - tune() reports the same failure per problem
            compiled[name] = 0
    return compiled
