"""The final round's power-steady regime: what a user's loop gets once clocks and power have settled.

A 40 ms burst measures a cool chip: on the H100 cuBLAS slowed 3% and a TMA tile 7% from burst to a 3 s loop
(issue 27), so a tile that tied aten in a burst lost to it in the loop. Here the finalists run after a heat-up, each
back to back for a window long enough to be past the switch from the previous one, alternated round by round so a
drift hits all alike, on the rotating input sets of the first pass. The baseline runs twice a round: the gap between
its two windows is the spread this measurement shows for one call against itself, and a challenger must beat the
baseline by more than that to replace it (`steady_winner`).

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
        drift between rounds cancels in each ratio. 1.0 for the baseline itself."""
        return statistics.median(self.ratios) if self.ratios else 1.0

    def as_dict(self) -> dict:
        return {"median_ms": self.median_ms, "ratio": round(self.ratio, 5),
                "windows_ms": [round(w, 6) for w in self.windows_ms]}


@dataclass
class SteadyResult:
    """The regime's outcome: per finalist its windows, the baseline's spread against itself (the median over rounds
    of |first - second window| / their mean), failures."""
    timings: dict[str, SteadyTiming]
    baseline: str
    self_spread: float
    plan: SteadyPlan
    seconds: float = 0.0
    failures: dict[str, str] = field(default_factory=dict)


class WindowClock(Protocol):
    """Runs `name` back to back: `untimed` calls, then `timed` calls; returns a reader of ms per timed call (read
    after the round, so the GPU never idles between windows waiting on the host)."""

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


def measure_steady(clock: WindowClock, estimate_ms: dict[str, float], baseline: str, plan: SteadyPlan,
                   ) -> SteadyResult:
    """Heat up on the baseline, then `plan.rounds` rounds in which every finalist (`estimate_ms`: name -> a first
    estimate of its ms per call, which sizes its window) runs one window, the order rotating each round, and the
    baseline a second window half a round after its first. A finalist whose call raises is dropped with the reason."""
    started = time.perf_counter()
    names = [n for n in estimate_ms if n != baseline]
    failures: dict[str, str] = {}

    def calls_in(name: str, ms: float) -> int:
        return max(1, int(ms / max(estimate_ms[name], 1e-4)))

    if plan.heat_ms > 0:
        clock(baseline, calls_in(baseline, plan.heat_ms), 1)()
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
            window = calls_in(name, plan.window_ms)
            untimed = max(1, int(window * plan.settle_fraction))
            try:
                readers.append((name, clock(name, untimed, max(1, window - untimed))))
            except Exception as e:  # noqa: BLE001 - a failing finalist is a result, not the end of the round
                failures[name] = f"{type(e).__name__}: {str(e)[:300]}"
        this_round: dict[str, float] = {}
        base_pair = []
        for name, read in readers:
            try:
                ms = read()
            except Exception as e:  # noqa: BLE001
                failures[name] = f"{type(e).__name__}: {str(e)[:300]}"
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
                            f"{result.timings[base].median_ms * 1e3:.1f} us; {base} against itself "
                            f"{result.self_spread:.1%})")


# Calls at least this long are bound by the GPU's compute or memory, so its power state decides their speed; below,
# the host's launch cost does (the final round ranks those by GPU time: kernels.tune.final_round).
STEADY_MIN_MS = 0.1
# The regime, from experiments/steady_regime.py on the H100 (2026-11-25, docs/measurements/
# steady_regime_h100_fifteenth.json): under load the card reaches its 700 W cap within ~0.8 s and holds 1200-1470 MHz
# (1980 idle-to-burst), and aten's 4096x11008x4096 goes from 0.48 ms per call cool to 0.56 in a 3 s loop. Of heat-ups
# 0 / 0.5 / 1.5 s and windows 25 / 50 / 100 / 200 ms (3 rounds each), 25 ms windows after a heat-up showed the
# smallest spread of aten against itself (0.0-1.2%, median over rounds) and put the best Triton tile on the right side
# of aten on all four large problems, as the 3 s loops did; longer windows caught the cap's periodic dips (aten's
# windows 4-17% apart). More rounds of short windows buy more than longer windows.
HEAT_MS = 500.0
WINDOW_MS = 25.0
ROUNDS = 8
# a challenger must beat the baseline by more than its spread against itself, and at least this much
MARGIN_FLOOR = 0.01


def plan_for(device: str) -> SteadyPlan:
    """The regime's plan on `device`: the measured one on a GPU; off the GPU (the interpreter) a token one that runs
    the same code path in milliseconds."""
    if device == "cuda":
        return SteadyPlan(heat_ms=HEAT_MS, window_ms=WINDOW_MS, rounds=ROUNDS)
    return SteadyPlan(heat_ms=0.0, window_ms=0.0, rounds=2)


# A challenger that wins the short windows meets the baseline again alone in long ones (half of each window untimed,
# while the power control settles on it): the H100's clock follows the power drawn over ~0.2 s (aten's
# 4096x11008x4096 went from 0.48 to 0.53 ms per call in its first 200 ms), so 25 ms windows alternated with aten
# run a kernel at a clock set partly by aten's draw. On the H100 (issue27 bench, 2026-11-25) CUTLASS finalists ran
# 3-5% slower against aten in their own 1.5 s loops than in the short windows; Triton tiles were within 3% of their
# loops (experiments/steady_regime.py). Paid only when a challenger is about to win.
CONFIRM_WINDOW_MS = 300.0
CONFIRM_ROUNDS = 2


def confirm_plan(device: str) -> SteadyPlan:
    if device == "cuda":
        return SteadyPlan(heat_ms=0.0, window_ms=CONFIRM_WINDOW_MS, rounds=CONFIRM_ROUNDS, settle_fraction=0.5)
    return SteadyPlan(heat_ms=0.0, window_ms=0.0, rounds=2)


def window_clock(calls: dict[str, Call], n_sets: int, device: str) -> WindowClock:
    return CudaWindows(calls, n_sets) if device == "cuda" else HostWindows(calls, n_sets)
