"""The final round's power-steady regime: what a user's loop gets once clocks and power have settled.

A 40 ms burst measures a cool chip: on the H100 cuBLAS slowed 3% and a TMA tile 7% from burst to a 3 s loop
(issue 27), so a tile that tied aten in a burst lost to it in the loop. Here calls run back to back in windows long
enough for the card's power control to settle on each (the first part of each window untimed), alternated so that a
drift hits all alike, on the rotating input sets of the first pass. The baseline runs between the others: the gap
between its windows is the spread this measurement shows for one call against itself, and a challenger must beat
the baseline by more than that to replace it (`steady_winner`). The tuner's final round is a duel (`measure_duel`:
the baseline and the first pass's best challenger); bench.compare's rows time every column (`measure_steady`).

The clock is injectable (`WindowClock`), so the rule is tested on CPU with a fake chip that heats up.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import torch

from kernels.measure.timing import Call


@dataclass(frozen=True)
class SteadyPlan:
    """How long each part of the regime runs (milliseconds) and how many rounds; the values and the measurement
    behind them are at `plan_for` below."""
    heat_ms: float
    window_ms: float
    rounds: int
    settle_fraction: float = 0.25     # leading part of each window left untimed: the switch from the previous call

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class SteadyTiming:
    """One finalist: ms per call in each of its windows, in order, and its per-round ratio to the baseline."""
    windows_ms: list[float]
    ratios: list[float] = field(default_factory=list)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.windows_ms)

    @property
    def ratio(self) -> float:
        """Median over rounds of (this window / the mean of the baseline's two windows of that round): the clock's
        drift between rounds cancels in each ratio. A duel stopped at the challenger's first window (measure_duel's
        `hopeless`) has one ratio, to the baseline's first window alone. 1.0 for the baseline itself."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "ratio": round(self.ratio, 5),
                "windows_ms": [round(w, 6) for w in self.windows_ms]}


@dataclass
class SteadyResult:
    """The regime's outcome: per finalist its windows, the baseline's spread against itself (the median over rounds
    of |first - second window| / their mean), failures, whether a duel ended at the challenger's first window."""
    timings: dict[str, SteadyTiming]
    baseline: str
    self_spread: float
    plan: SteadyPlan
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)
    stopped_early: bool = False       # a duel ended at the challenger's first window (measure_duel's `hopeless`)


class WindowClock(Protocol):
    """Runs `name` back to back: `untimed` calls, then `timed` calls; returns a reader of ms per timed call (read
    after the round, so the GPU never idles between windows waiting on the host; measure_duel reads the challenger's
    first window before it enqueues the next, a gap the next window's untimed start absorbs)."""

    def __call__(self, name: str, untimed: int, timed: int) -> Callable[[], float]: ...


class CudaWindows:
    """WindowClock on the GPU: calls enqueued back to back, CUDA events around the timed part. The host runs ahead of
    a device-bound call, so windows follow each other on the GPU with no gap, as in a user's loop."""

    def __init__(self, calls: dict[str, Call], n_sets: int):
        self.calls, self.n_sets = calls, max(1, n_sets)
        self.counter = 0

    def _run(self, call: Call, count: int) -> None:
        for _ in range(count):
            call(self.counter % self.n_sets)
            self.counter += 1

    def __call__(self, name: str, untimed: int, timed: int) -> Callable[[], float]:
        call = self.calls[name]
        self._run(call, untimed)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self._run(call, timed)
        end.record()
        return lambda: (end.synchronize(), start.elapsed_time(end) / max(timed, 1))[1]


class HostWindows(CudaWindows):
    """WindowClock off the GPU (the interpreter, CPU tensors): the host clock around synchronous calls."""

    def __call__(self, name: str, untimed: int, timed: int) -> Callable[[], float]:
        call = self.calls[name]
        self._run(call, untimed)
        t0 = time.perf_counter()
        self._run(call, timed)
        ms = (time.perf_counter() - t0) * 1e3 / max(timed, 1)
        return lambda: ms


def _calls_in(ms: float, estimate_ms: float) -> int:
    """Calls of `estimate_ms` each that fill `ms` (one at least)."""
    return max(1, int(ms / max(estimate_ms, 1e-4)))


def _failure(e: Exception) -> str:
    """What a finalist's failure is recorded as."""
    return f"{type(e).__name__}: {str(e)[:300]}"


def measure_steady(clock: WindowClock, estimate_ms: dict[str, float], baseline: str, plan: SteadyPlan,
                   ) -> SteadyResult:
    """Heat up on the baseline, then `plan.rounds` rounds in which every finalist (`estimate_ms`: name -> a first
    estimate of its ms per call, which sizes its window) runs one window, the order rotating each round, and the
    baseline a second window half a round after its first. A finalist whose call raises is dropped with the reason."""
    started = time.perf_counter()
    names = [n for n in estimate_ms if n != baseline]
    failures: dict[str, str] = {}

    if plan.heat_ms > 0:
        clock(baseline, _calls_in(plan.heat_ms, estimate_ms[baseline]), 1)()
    windows: dict[str, list[float]] = {n: [] for n in [baseline, *names]}
    spreads: list[float] = []
    ratios: dict[str, list[float]] = {}
    for r in range(plan.rounds):
        shift = r % max(1, len(names))
        order = names[shift:] + names[:shift]
        half = (len(order) + 1) // 2
        # baseline, first half, baseline again, second half: its two windows are as far apart as the round allows
        sequence = [baseline, *order[:half], baseline, *order[half:]]
        readers: list[tuple[str, Callable[[], float]]] = []
        for name in sequence:
            if name in failures:
                continue
            window = _calls_in(plan.window_ms, estimate_ms[name])
            untimed = max(1, int(window * plan.settle_fraction))
            try:
                readers.append((name, clock(name, untimed, max(1, window - untimed))))
            except Exception as e:  # noqa: BLE001 - a failing finalist is a result, not the end of the round
                failures[name] = _failure(e)
        this_round: dict[str, float] = {}
        base_pair = []
        for name, read in readers:
            try:
                ms = read()
            except Exception as e:  # noqa: BLE001
                failures[name] = _failure(e)
                continue
            windows[name].append(ms)
            if name == baseline:
                base_pair.append(ms)
            else:
                this_round[name] = ms
        if baseline in failures:
            break
        if len(base_pair) == 2:
            base_ms = (base_pair[0] + base_pair[1]) / 2
            spreads.append(abs(base_pair[0] - base_pair[1]) / base_ms)
            for name, ms in this_round.items():
                ratios.setdefault(name, []).append(ms / base_ms)
    timings = {n: SteadyTiming(w, ratios.get(n, [])) for n, w in windows.items() if w and n not in failures}
    return SteadyResult(timings=timings, baseline=baseline,
                        self_spread=statistics.median(spreads) if spreads else 0.0, plan=plan,
                        seconds=time.perf_counter() - started, failures=failures)


def measure_duel(clock: WindowClock, estimate_ms: dict[str, float], baseline: str, challenger: str, plan: SteadyPlan,
                 decided: Callable[[float, float], bool] | None = None,
                 hopeless: Callable[[float], bool] | None = None) -> SteadyResult:
    """The baseline and one challenger in turn, B C B C B ... (`plan.rounds` challenger windows at most): each
    challenger window is compared with the baseline's windows on either side of it, and each baseline window serves
    the rounds on both its sides. After a round, `decided(median ratio so far, the baseline's median spread so far)`
    may end the duel. `hopeless(challenger's first window / the baseline's first)` may end it before the first
    round's closing baseline window (the challenger window is then read before that one is enqueued; the closing
    window's untimed start covers the gap); the round's ratio is then that one. A call that raises ends it with the
    reason. No heat-up: the baseline's first window, its first part untimed, is one (a plan with `heat_ms` is
    refused)."""
    if plan.heat_ms > 0:
        raise ValueError(f"measure_duel runs no heat-up; the plan asks for {plan.heat_ms} ms")
    started = time.perf_counter()
    windows: dict[str, list[float]] = {baseline: [], challenger: []}
    ratios: list[float] = []
    spreads: list[float] = []
    failures: dict[str, str] = {}

    def window(name: str) -> Callable[[], float]:
        count = _calls_in(plan.window_ms, estimate_ms[name])
        untimed = max(1, int(count * plan.settle_fraction))
        return clock(name, untimed, max(1, count - untimed))

    def run(names: list[str]) -> list[float] | None:
        """Enqueue one window of each name, then read them all (the GPU never waits on the host in between)."""
        readers = []
        for name in names:
            try:
                readers.append((name, window(name)))
            except Exception as e:  # noqa: BLE001 - a failing finalist is a result, not the end of the caller
                failures[name] = _failure(e)
                break
        values = []
        for name, read in readers:
            try:
                values.append(read())
            except Exception as e:  # noqa: BLE001
                failures.setdefault(name, _failure(e))
                return None
            windows[name].append(values[-1])
        return values if len(values) == len(names) else None

    first = run([baseline])
    stopped_early = False
    if first is not None:
        before = first[0]
        for round_ in range(plan.rounds):
            if round_ == 0 and hopeless is not None:
                alone = run([challenger])
                if alone is None:
                    break
                if before > 0 and hopeless(alone[0] / before):
                    ratios.append(alone[0] / before)
                    stopped_early = True
                    break
                closing = run([baseline])
                got = None if closing is None else [alone[0], closing[0]]
            else:
                got = run([challenger, baseline])
            if got is None:
                break
            ms, after = got
            base_ms = (before + after) / 2
            ratios.append(ms / base_ms)
            spreads.append(abs(before - after) / base_ms)
            before = after
            if decided is not None and decided(statistics.median(ratios), statistics.median(spreads)):
                break
    if baseline in failures and challenger not in failures and not windows[challenger]:
        run([challenger])          # the baseline failed first: the challenger must still show that it runs
    timings = {n: SteadyTiming(w, ratios if n == challenger else []) for n, w in windows.items()
               if w and n not in failures}
    return SteadyResult(timings=timings, baseline=baseline,
                        self_spread=statistics.median(spreads) if spreads else 0.0, plan=plan,
                        seconds=time.perf_counter() - started, failures=failures, stopped_early=stopped_early)


def steady_winner(result: SteadyResult, floor: float) -> tuple[str, float, str]:
    """(winner, margin, why): the finalist lowest in ratio to the baseline wins if that ratio is below 1 - margin
    -- the margin being the baseline's spread against itself, at least `floor` -- else the baseline."""
    base = result.baseline
    margin = max(result.self_spread, floor)
    if base not in result.timings:
        if not result.timings:
            raise ValueError("steady round: no finalist ran")
        fastest = min(result.timings, key=lambda n: result.timings[n].median_ms)
        return fastest, margin, f"steady round: {base} failed; {fastest} fastest"
    challengers = {n: t.ratio for n, t in result.timings.items() if n != base and t.ratios}
    if not challengers:
        return base, margin, f"steady round: {base} alone"
    fastest = min(challengers, key=challengers.get)
    beats = challengers[fastest] < 1 - margin
    winner = fastest if beats else base
    return winner, margin, (f"steady round: {fastest} {'beats' if beats else 'does not beat'} {base} by more than "
                            f"{margin:.1%} ({challengers[fastest]:.3f}x its time per call, "
                            f"{result.timings[fastest].median_ms * 1e3:.1f} vs "
                            f"{result.timings[base].median_ms * 1e3:.1f} us; " +
                            (f"{base}'s closing window not run)" if result.stopped_early else
                             f"{base} against itself {result.self_spread:.1%})"))


# Calls at least this long are bound by the GPU's compute or memory, so its power state decides their speed; below,
# the host's launch cost does (the final round ranks those by GPU time: kernels.tune.final_round).
STEADY_MIN_MS = 0.1
# The regime: windows long enough that the card's power control settles on each call, the first half of each untimed.
# The H100's clock follows the power drawn over ~0.2 s and reaches its 700 W cap ~0.8 s into a load (1980 -> 1200-1470
# MHz; experiments/steady_regime.py, fifteenth session), so short windows alternated with aten run a call at a clock
# set partly by aten's draw: 25 ms windows flattered CUTLASS tiles by 3-5% on the H100 and by up to 16% on the H200
# (twenty-first session). 300 ms windows (twenty-second to twenty-fifth sessions) alias with a ~0.9 s oscillation of
# the power control that follows a load's start: aten's second window, 0.75-0.9 s in, ran >= 3% slower than its first
# and third in 24 of 28 duels on an H100 (16 of 21 on the H200), aten's spread against itself reached 5-20%, the duel's
# ratio strayed from 1.5 s loops by up to 9.5% (H100) after a first pass, and on the H100 fp8 CUTLASS tiles 4.3% and
# 5.9% faster than aten in the loops lost their duels (regret 5.8-6.1%). 1 s windows, B C B, read within 1.4% (H100)
# and 0.3% (H200) of the loops on seven llama-layer problems, aten against itself <= 1.9%
# (experiments/duel_prelude.py --long, after 1 s of aten; docs/measurements/duel_prelude_*_twentysixth_call{3,4}.jsonl,
# twenty-sixth session): one round of them decides. Tuning runs no such heat-up (the first window's untimed half is
# one); with it as it runs, issue 30's fp8 picks and three bf16 ones on an H100 had a regret of 0-0.5% against 1.5 s
# loops (docs/measurements/long_sustained_*_h100_twentysixth_call8.*). A duel now takes 2-3.3 s (0.6-1.5 s before) --
# accuracy first (issue 27); the 1.5% margin (kernels.tune.final_round) is thin against the H100's 1.4%.
WINDOW_MS = 1000.0
SETTLE_FRACTION = 0.5
ROUNDS = 1
# a challenger must beat the baseline by more than its spread against itself, and at least this much
MARGIN_FLOOR = 0.01


def plan_for(device: str) -> SteadyPlan:
    """The regime's plan on `device`: the measured one on a GPU; off the GPU (the interpreter) a token one that runs
    the same code path in milliseconds."""
    if device == "cuda":
        return SteadyPlan(heat_ms=0.0, window_ms=WINDOW_MS, rounds=ROUNDS, settle_fraction=SETTLE_FRACTION)
    return SteadyPlan(heat_ms=0.0, window_ms=0.0, rounds=ROUNDS)


def window_clock(calls: dict[str, Call], n_sets: int, device: str) -> WindowClock:
    return CudaWindows(calls, n_sets) if device == "cuda" else HostWindows(calls, n_sets)
