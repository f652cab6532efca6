"""The one selection routine, shared by tuning (kernels.tune.autotune) and by dynamic shapes' bucket benchmarks
(kernels.dispatch.dynamic): a first pass over every candidate, then a final round among the fastest and the baseline
(the simplest candidate, aten) in the regime users run.

- Calls of STEADY_MIN_MS or more (bound by the GPU's compute or memory): a duel in the power-steady regime
  (kernels.measure.steady): the baseline against the first pass's fastest other candidate, in turn, in windows long
  enough for the card's power control to settle on each. The baseline is kept unless the challenger beats it there by
  more than the baseline's spread against itself. This replaced, for these calls, the tie tolerance and the
  20th-percentile guard: on the H100 a TMA tile that tied aten in 40 ms bursts ran 0.963x it in a 3 s loop (issue
  27); and it replaced a round of short windows over the fastest three, which on the H200 flattered CUTLASS tiles by
  up to 16% and so always needed the long windows after it. The duel's windows are 1 s since 300 ms ones aliased with
  the power control's oscillation (kernels.measure.steady): B C B, 3 s, or B C, 2 s, where the challenger's first
  window leaves it no way to win (first_window_bound).
- Shorter calls: their speed is set by the host's launch cost as much as by the GPU, and the chip never reaches its
  power cap on them; the final round times them in short interleaved samples and ranks host-set calls by GPU time
  (`_burst_pick`; each rule below carries the measurement that keeps it).

The regime that chose the winner is recorded in the Selection (`regime`: "steady" or "burst").
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from kernels.core import counters
from kernels.core.config import config
from kernels.core.selection import NOT_VERIFIED
from kernels.measure.steady import (
    MARGIN_FLOOR,
    STEADY_MIN_MS,
    SteadyPlan,
    SteadyResult,
    SteadyTiming,
    WindowClock,
    measure_duel,
    measure_steady,
    plan_for,
    steady_winner,
    window_clock,
)
from kernels.measure.timing import (
    HOST_SET_MAX_MS,
    LAUNCH_GAP_MS,
    QUICK_SCREEN,
    TUNE_CUTOFF,
    Call,
    device_time_ms,
    measure_interleaved,
    measure_together,
)
from kernels.measure.verify import VERIFIED_TOP
from kernels.space.families import complexity, one_launch

if TYPE_CHECKING:
    from kernels.core.choice import Choice

REGIMES = ("steady", "burst")


class StageClock:
    """Seconds per tuning stage, summed over entries (candidates and build run once per backend); each stage is
    announced to `on_stage` (the progress line). A stage entered inside another (verification inside the final
    round) is counted to itself alone: the stages' seconds add up to the tune's."""

    def __init__(self, on_stage: Callable[[str], None] | None = None):
        self.seconds: dict[str, float] = {}
        self.on_stage = on_stage
        self._open: list[str] = []

    @contextlib.contextmanager
    def __call__(self, stage: str):
        if self.on_stage is not None:
            self.on_stage(stage)
        start = time.perf_counter()
        self._open.append(stage)
        try:
            yield
        finally:
            self._open.pop()
            took = time.perf_counter() - start
            self.seconds[stage] = self.seconds.get(stage, 0.0) + took
            if self._open:
                outer = self._open[-1]
                self.seconds[outer] = self.seconds.get(outer, 0.0) - took
                if self.on_stage is not None:
                    self.on_stage(outer)


@dataclass
class Outcome:
    """What `select` found: the winner (None when nothing ran), the regime that chose it, every candidate's time
    (ms; the final round's for finalists) or failure, per-candidate details, the finalists, notes."""
    winner: str | None
    regime: str
    timings: dict[str, float | str] = field(default_factory=dict)
    details: dict[str, dict] = field(default_factory=dict)
    finalists: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    duel: str | None = None      # the challenger of a deferred duel (select's `defer_duel`)


def select(calls: dict[str, Call], choices: dict[str, Choice], n_sets: int, device: str, budget_ms: float, *,
           isolated: Callable[[bool], dict[str, tuple[float, Call]]] | None = None,
           timings: dict[str, float | str] | None = None, details: dict[str, dict] | None = None,
           clock: StageClock | None = None, windows: Callable[[dict[str, Call]], WindowClock] | None = None,
           verify: Callable[[str], str | None] | None = None, verify_all: bool = False,
           defer_duel: bool = False) -> Outcome:
    """First pass over `calls` (interleaved, `budget_ms` each, the slow ones dropped at TUNE_CUTOFF), then the
    final round over the fastest, the baseline always among them. `isolated`: asked after the first pass, the
    candidates it verified and timed elsewhere (a child process: name -> (first-pass ms, the call here)), which join
    the final round; asked then so that the child's start-up overlaps this process's first pass. Its argument says
    whether the caller's calls will finish the selection (`defer_duel` in the steady regime): it may then leave its
    candidates to them rather than wait for the child (kernels.dispatch.selected). `windows` builds the
    steady round's clock (default: CUDA events on a GPU; tests give a fake chip). `verify`: name -> None when the
    candidate computes the right result, else why not; `calls` are then unverified: the first pass's screen is set
    by a verified candidate, the fastest VERIFIED_TOP are verified before the regime is chosen (all of them with
    `verify_all`), and every finalist before its final round (OnDemandCheck); without `verify` they must have been
    verified already. `defer_duel`: a steady-regime duel is not run here; the Outcome names its challenger (`duel`),
    verified, and the baseline wins until the duel on the caller's calls decides (kernels.dispatch.call_duel)."""
    clock = clock or StageClock()
    timings = {} if timings is None else timings
    details = {} if details is None else details
    checked = OnDemandCheck(verify, timings, clock)
    with clock("first_pass"):
        # the screen on the GPU only: an interpreted call's one-call time is not its kernel's
        timed, crashed = measure_interleaved(calls, n_sets, device, budget_ms, cutoff=TUNE_CUTOFF,
                                             screen=QUICK_SCREEN if device == "cuda" else None,
                                             trusted=(lambda name: checked(name, {})) if verify else None)
    for name, why in crashed.items():
        timings[name] = f"crashed while timing: {why}"
    for name, t in timed.items():
        counters.bump("benchmarks")
        timings[name] = t.median_ms
        details[name] = t.as_dict()
    runnable = {n: c for n, c in calls.items() if n in timed}
    measured_elsewhere = {}
    if isolated is not None:    # the child's cutoffs start from this process's fastest first pass: a verified one
        checked.fastest({n: timings[n] for n in runnable}, 1)
        here = [t for n in runnable if isinstance(t := timings.get(n), float)]
        steady = windows is not None or (device == "cuda" and bool(here) and min(here) >= STEADY_MIN_MS)
        measured_elsewhere = isolated(defer_duel and steady)
    for name, (ms, call) in measured_elsewhere.items():
        timings[name] = ms
        runnable[name] = call
        checked.passed.add(name)        # verified where it was timed
    notes: list[str] = []
    if not any(isinstance(timings.get(n), float) for n in runnable):
        return Outcome(None, "burst", timings, details, [], notes)
    sub = {n: timings[n] for n in runnable if isinstance(timings.get(n), float)}
    checked.fastest(sub, None if verify_all else VERIFIED_TOP)
    deferred: list[str] = []
    winner, regime, finalists = pick_winner(sub, choices, runnable, n_sets, device, details, notes, clock,
                                            windows=windows, check=lambda name: checked(name, sub),
                                            deferred=deferred if defer_duel else None)
    unchecked = [n for n in sub if not checked.done(n)]
    for name in unchecked:
        timings[name] = not_verified(sub.pop(name))
    if unchecked:
        notes.append(f"{len(unchecked)} candidate(s) timed but not verified: the final round could not take them")
    timings.update(sub)
    return Outcome(winner, regime, timings, details, finalists, notes, duel=deferred[0] if deferred else None)


def not_verified(first_pass_ms: float) -> str:
    return f"{NOT_VERIFIED} (first pass {first_pass_ms * 1e3:.1f} us): not a finalist"


class OnDemandCheck:
    """Verification when a candidate may be run by a Selection's readers, once per candidate: the first pass's screen
    reference, its fastest VERIFIED_TOP, the steady regime's baseline and challenger, every candidate of the burst
    regime (all with `select(verify_all=True)`). Checking a large output costs about as much as the call it checks,
    and tuning verified 28 Triton tiles, two launch paths each, of which a steady-regime problem duels one: 0.36 s of
    bf16 8192x14336x4096's 3.5 s tune on the H200, 0.02 s on demand (thirty-first session). A candidate that fails
    leaves the pool (`timings[name]` says why); one that was never asked stays unverified and cannot win."""

    def __init__(self, verify: Callable[[str], str | None] | None, timings: dict[str, float | str],
                 clock: StageClock):
        self.verify, self.timings, self.clock = verify, timings, clock
        self.passed: set[str] = set()

    def fastest(self, pool: dict[str, float], count: int | None) -> None:
        """Verify `pool`'s candidates fastest first until `count` have passed (all of them for None)."""
        passed = 0
        for name in sorted(pool, key=pool.get):
            if count is not None and passed >= count:
                return
            passed += self(name, pool)

    def done(self, name: str) -> bool:
        """Whether `name` may be used as verified."""
        return self.verify is None or name in self.passed

    def __call__(self, name: str, pool: dict[str, float]) -> bool:
        """Whether `name` computes the right result; verified now if it was not yet (a failure leaves `pool`)."""
        if self.done(name):
            return True
        with self.clock("verify"):
            why = self.verify(name)
        if why is None:
            self.passed.add(name)
            return True
        self.timings[name] = why
        pool.pop(name, None)
        return False


def pick_winner(timings: dict[str, float], choices, calls: dict[str, Call], n_sets: int, device: str,
                details: dict[str, dict], notes: list[str], clock: StageClock | None = None, *,
                windows: Callable[[dict[str, Call]], WindowClock] | None = None,
                check: Callable[[str], bool] | None = None, deferred: list[str] | None = None,
                **rules) -> tuple[str | None, str, list[str]]:
    """(winner, regime, finalists) from first-pass `timings` (name -> ms, updated in place with the final round's).
    The steady regime where the fastest first pass is STEADY_MIN_MS or more on a GPU (or wherever `windows` is
    given), the burst rules below it. `check(name)`: whether a candidate is verified, verifying it if need be (one
    that fails leaves `timings`); every finalist passes it first. `deferred`: given, a steady duel is not run; its
    challenger is appended to it and the baseline wins for now."""
    clock = clock or StageClock()
    ranked = sorted((t, n) for n, t in timings.items() if isinstance(t, float))
    if not ranked:
        return None, "burst", []
    if windows is not None or (device == "cuda" and ranked[0][0] >= STEADY_MIN_MS):
        make = windows or (lambda fns: window_clock(fns, n_sets, device))
        winner, finalists = _steady_pick(timings, choices, calls, make, device, details, notes, clock, check,
                                         deferred)
        return winner, "steady", finalists
    if check is not None:       # burst calls are small: each check is cheap, and the rules below rank many
        for _, name in ranked:
            if not check(name):
                timings.pop(name, None)
    finalists: list[str] = []
    winner = _burst_pick(timings, choices, calls, n_sets, device, details, notes, clock, finalists=finalists,
                         **rules)
    return winner, "burst", finalists


def _baseline(timings: dict[str, float | str], choices) -> str:
    """The simplest timed candidate (aten when it ran), the fastest of equals: the one a challenger must beat."""
    timed = [n for n, t in timings.items() if isinstance(t, float)]
    return min(timed, key=lambda n: (complexity(choices[n]), timings[n]))


def _steady_pick(timings, choices, calls, make_clock, device, details, notes, clock: StageClock,
                 check: Callable[[str], bool] | None = None,
                 deferred: list[str] | None = None) -> tuple[str | None, list[str]]:
    """The baseline against the first pass's fastest other candidate, in the power-steady regime's long windows
    (kernels.measure.steady.measure_duel); the baseline is kept unless the challenger beats it there by more than
    the baseline's own spread (kernels.measure.steady.steady_winner). No duel when that challenger's first pass is
    more than CHALLENGER_WITHIN behind the baseline's. Each of the two passes `check` before it runs here."""
    baseline = _checked_baseline(timings, choices, check)
    if baseline is None:
        notes.append("steady round: none ran: every candidate failed verification")
        return None, []
    others = sorted((t, n) for n, t in timings.items() if isinstance(t, float) and n != baseline)
    contenders = contenders_of(baseline, timings)
    if not contenders:
        details.setdefault(baseline, {})["final_ms"] = timings[baseline]
        notes.append(f"steady round: none ran: no candidate within {CHALLENGER_WITHIN:.0%} of {baseline}'s first "
                     f"pass" + (f" (the fastest other, {others[0][1]}, at {others[0][0] / timings[baseline]:.3f}x)"
                                if others else ""))
        return baseline, [baseline]
    if deferred is not None:
        challenger = next((n for n in contenders if check is None or check(n)), None)
        if challenger is None:
            details.setdefault(baseline, {})["final_ms"] = timings[baseline]
            notes.append(f"steady round: none ran: the {len(contenders)} candidate(s) within {CHALLENGER_WITHIN:.0%} "
                         f"of {baseline}'s first pass failed verification")
            return baseline, [baseline]
        deferred.append(challenger)
        notes.append(f"steady round: {challenger} (first pass {timings[challenger] / timings[baseline]:.3f}x "
                     f"{baseline}'s) duels {baseline} on the caller's calls; {baseline} serves until it is decided")
        return baseline, [baseline, challenger]
    with clock("final_round"):
        result, crashed = _duels(baseline, contenders, timings, calls, make_clock, plan_for(device), check)
    if result is None:
        details.setdefault(baseline, {})["final_ms"] = timings[baseline]
        notes.append(f"steady round: none ran: the {len(contenders)} candidate(s) within {CHALLENGER_WITHIN:.0%} of "
                     f"{baseline}'s first pass failed verification")
        return baseline, [baseline]
    if not result.timings:
        notes.append(f"steady round: every finalist crashed ({', '.join(crashed)})")
        return None, []
    winner, why = record_duel(result, timings, details)
    notes.append(f"{why}; regime: {duel_shape(result)} of {result.plan.window_ms:.0f} ms windows (the first half "
                 f"untimed), {result.seconds:.2f} s" + (f"; crashed in it: {', '.join(crashed)}" if crashed else ""))
    return winner, list(result.timings)


def contenders_of(baseline: str, timings: dict[str, float | str], among: set[str] | None = None) -> list[str]:
    """Who may duel the baseline: the timed candidates (`among` them, if given) whose first pass is within
    CHALLENGER_WITHIN of the baseline's, fastest first."""
    limit = timings[baseline] * (1 + CHALLENGER_WITHIN)
    ranked = sorted((t, n) for n, t in timings.items()
                    if isinstance(t, float) and n != baseline and (among is None or n in among))
    return [n for t, n in ranked if t <= limit]


def _rounds(result: SteadyResult) -> int:
    """The duel's rounds: its challenger's ratios (0 where no challenger ran)."""
    challenger = next((n for n in result.timings if n != result.baseline), None)
    return len(result.timings[challenger].ratios) if challenger is not None else 0


def duel_shape(result: SteadyResult) -> str:
    """How far a duel ran: 'N round(s)', or its stop at the challenger's first window."""
    return "the challenger's first window" if result.stopped_early else f"{_rounds(result)} round(s)"


def record_duel(result: SteadyResult, timings: dict[str, float | str], details: dict[str, dict]) -> tuple[str, str]:
    """(winner, why) of a duel's result (steady_winner, one round judged with ONE_ROUND_FLOOR), its windows written
    into the finalists' `details` and their final times into `timings` (the first pass's time moves to the
    details). Shared by the tune's duel and the one on the caller's calls (kernels.dispatch.call_duel)."""
    baseline = result.baseline
    for name, t in result.timings.items():
        d = details.setdefault(name, {})
        first = timings.get(name)
        if isinstance(first, float) and "final_ms" not in d:
            d["first_pass_ms"] = first
        d["final_ms"] = t.median_ms
        d["final_windows_ms"] = [round(w, 6) for w in t.windows_ms]
        if t.ratios:
            d["final_ratio"] = round(t.ratio, 5)
            if result.stopped_early:        # then to the baseline's first window alone
                d["first_window_stop"] = True
        timings[name] = t.median_ms
    rounds = _rounds(result)
    winner, _, why = steady_winner(result, ONE_ROUND_FLOOR if rounds == 1 else MARGIN_FLOOR)
    if rounds and not result.stopped_early and baseline in details:
        details[baseline]["self_spread"] = round(result.self_spread, 5)
    return winner, why


def call_duel_result(baseline: str, challenger: str, windows_ms: list[float], plan: SteadyPlan,
                     seconds: float = 0.0) -> SteadyResult | None:
    """A one-round duel's result from its windows' ms per call in the order they ran on the caller's calls (baseline,
    challenger, baseline), as measure_duel makes it from its loop; None while undecided: the challenger's window is
    in and not `_hopeless`, the closing window is not."""
    if len(windows_ms) < 2 or any(w <= 0 for w in windows_ms):
        return None
    first, alone = windows_ms[0], windows_ms[1]
    if _hopeless(alone / first):
        return SteadyResult({baseline: SteadyTiming([first]), challenger: SteadyTiming([alone], [alone / first])},
                            baseline, 0.0, plan, seconds=seconds, stopped_early=True)
    if len(windows_ms) < 3:
        return None
    closing = windows_ms[2]
    mean = (first + closing) / 2
    return SteadyResult({baseline: SteadyTiming([first, closing]), challenger: SteadyTiming([alone], [alone / mean])},
                        baseline, abs(first - closing) / mean, plan, seconds=seconds)


def _checked_baseline(timings: dict[str, float], choices, check: Callable[[str], bool] | None) -> str | None:
    """The baseline (`_baseline`) among the candidates that pass `check` (a failure leaves `timings`)."""
    while any(isinstance(t, float) for t in timings.values()):
        name = _baseline(timings, choices)
        if check is None or check(name):
            return name
        timings.pop(name, None)
    return None


def _duels(baseline: str, contenders: list[str], timings, calls, make_clock, plan,
           check: Callable[[str], bool] | None = None) -> tuple[SteadyResult | None, list[str]]:
    """The baseline's duel with the first contender that passes `check`; with the next one where the challenger
    crashed (after the baseline crashed, the next contender need only show that it runs). Returns the last result
    (it holds the outcome: both, one, or none left; None when no contender passed `check`) and the names that
    crashed; their timings become the failure."""
    crashed: list[str] = []
    baseline_ran = True
    seconds = 0.0
    result = None
    for challenger in contenders:
        if check is not None and not check(challenger):
            continue
        if baseline_ran:
            result = measure_duel(make_clock({n: calls[n] for n in (baseline, challenger)}),
                                  {n: timings[n] for n in (baseline, challenger)}, baseline, challenger, plan,
                                  decided=_decided, hopeless=_hopeless if plan.rounds == 1 else _far_behind)
        else:
            result = measure_steady(make_clock({challenger: calls[challenger]}), {challenger: timings[challenger]},
                                    challenger, replace(plan, rounds=1))
        seconds += result.seconds
        for name, why in result.failures.items():
            timings[name] = f"crashed in the final round: {why}"
            crashed.append(name)
        baseline_ran = baseline_ran and baseline not in result.failures
        if challenger in result.timings:
            break
    if result is not None:
        result.seconds = seconds
    return result, crashed


# The duel's challenger is the first pass's fastest candidate other than the baseline, if within this of the
# baseline's first pass. The first pass (a cool chip) flatters the kernels that draw the most power (bf16 CUTLASS
# tiles at 0.78-0.97x aten there ran 0.99-1.03x it in 1.5 s loops, H200, experiments/duel_regime.py) and over-charges
# the ones that draw less (fp8 TMA tiles at 1.035-1.09x aten in 25 ms windows ran 0.935-0.96x it in loops, H200): a
# challenger a little behind still meets aten. The first pass's fastest challenger was the loops' fastest on 9 of the
# 10 problems of that run (on the tenth aten beat both).
CHALLENGER_WITHIN = 0.10
# A duel ends after its first round when the challenger leads the baseline by no more than DUEL_FIRST_ROUND_LEAD (the
# baseline is kept), or by more than DUEL_CLEAR_WIN and the baseline's spread (the challenger wins); a one-round result
# keeps the baseline unless the challenger leads by more than this. With 1 s windows (kernels.measure.steady) one round
# read within 1.4% of 1.5 s loops on the H100 and 0.3% on the H200 (seven llama-layer problems, twenty-sixth session,
# docs/measurements/duel_prelude_*_twentysixth_call{3,4}.jsonl). (With the 300 ms windows before, the H200's first
# round erred by up to 3.4%: this was 3.5%.)
DUEL_FIRST_ROUND_LEAD = 0.015
DUEL_CLEAR_WIN = 0.15


# A one-round duel's verdict (the plan measured, kernels.measure.steady.ROUNDS) takes at least this margin: its ratio
# errs towards the challenger by up to DUEL_FIRST_ROUND_LEAD.
ONE_ROUND_FLOOR = max(MARGIN_FLOOR, DUEL_FIRST_ROUND_LEAD)


def first_window_bound(floor: float) -> float:
    """The challenger's first window over the baseline's first (C / B1) from which a one-round duel keeps the baseline
    whatever the baseline's closing window B2 reads, so that window need not run. The challenger wins when
    C / m < 1 - max(|B1 - B2| / m, floor), m = (B1 + B2) / 2, i.e. when C < m - max(|B1 - B2|, floor * m). The right
    side rises with B2 up to B2 = B1 (1 + floor/2) / (1 - floor/2), where B2 - B1 reaches floor * m, and falls
    beyond; there it is B1 (1 - floor) / (1 - floor/2). 0.99244 for the 1.5% floor: a challenger not 0.76% ahead of
    the baseline's first window cannot win, however slow or fast the closing window would read."""
    return (1 - floor) / (1 - floor / 2)


def _hopeless(first_window_ratio: float) -> bool:
    """Whether a one-round duel is already lost by the challenger at its first window (first_window_bound; a
    relative 1e-9 keeps float rounding at the bound on the side of running the closing window). Exact while
    `_steady_pick` judges one round with ONE_ROUND_FLOOR, the floor used here. The 1 s duels measured so far had
    C / B1 = 0.998-1.043 (14 of 14 at or above the bound; twenty-sixth session, after 1 s of aten) and within 1.1% of
    1 on 17 of 20 large problems in tuning (twenty-ninth): the stop ends most duels after two windows instead of
    three, with the verdict the three would give. A stopped duel records the baseline's first window alone as its
    final time, which reads a little slow (B2 ran 0.4-3.9% faster than B1 in the twenty-ninth session's duels); no
    rule compares it again (the dynamic buckets' 5% tie keeps aten: the challenger is at most 0.76% faster)."""
    return first_window_ratio >= first_window_bound(ONE_ROUND_FLOOR) * (1 + 1e-9)


# Plans of more than one round (experiments and tests; the measured plan has one) have no such bound, since later
# rounds move the median: their duel ends at the challenger's first window when that window is more than this slower
# than the baseline's first (chosen with the 300 ms windows, whose baseline spread reached 15.4% on an H100,
# twenty-fourth session, docs/measurements/cost5_sustained_h100_twentyfourth.jsonl).
DUEL_FIRST_WINDOW_BEHIND = 0.08


def _far_behind(first_window_ratio: float) -> bool:
    """A multi-round plan's first-window stop (DUEL_FIRST_WINDOW_BEHIND)."""
    return first_window_ratio > 1 + DUEL_FIRST_WINDOW_BEHIND


def _decided(ratio: float, spread: float) -> bool:
    """(Only for plans of more than one round: the measured plan has one, kernels.measure.steady.ROUNDS.)
    Whether a duel's first round already decides it: the challenger not ahead by more than the first round's
    error (DUEL_FIRST_ROUND_LEAD; a noisier baseline only makes a win harder to show), or ahead by more than
    DUEL_CLEAR_WIN and the baseline's spread against itself."""
    return ratio >= 1 - DUEL_FIRST_ROUND_LEAD or ratio <= 1 - max(DUEL_CLEAR_WIN, spread)


# Calls under STEADY_MIN_MS: how many of the first pass's fastest are re-timed side by side (with the baseline; more
# for calls under HOST_BOUND_MAX_MS) before the winner is chosen. 3 since the first version, not measured against
# other values; each one more costs a measurement budget in the final round
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


def _burst_pick(timings, choices, fns, n_sets, device, details, notes, clock: StageClock, *,
                retime_top: int = RETIME_TOP, cutoff: float = TUNE_CUTOFF,
                host_bound_tolerance: float = HOST_BOUND_TOLERANCE,
                finalists: list[str] | None = None) -> str | None:
    """Calls under STEADY_MIN_MS: re-time the fastest few together in short interleaved samples, then let the
    simplest win among those within the tie tolerance; host-set calls are ranked by GPU time (the rules below).

    The baseline (the simplest, aten) is also kept when a challenger beats its median while its 20th percentile is
    BASELINE_P20_MARGIN below the challenger's: interference only ever slows a call, and it does not slow all calls
    alike. On the H100, bf16 3000x2000x1000 ran episodes of 10-30 ms in which torch.mm took 1.3-8x its 23 us (4% of
    its samples, against 0.7% of a Triton tile's, which recovered sooner); one tune's final round measured aten above
    the 36 us of a TMA tile that it beat by 1.35x side by side a moment later. The margin: aten's own spread is wide
    (bf16 1024x8192x512: median 23.0 us, p20 18.9, against a tile's 20.7 / 20.3 that then ran 1.05x faster)."""
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
            gpu_ms = {n: device_time_ms(fns[n], n_sets) for t, n in ranked[:HOST_BOUND_SCREEN]
                      if t <= ranked[0][0] * SCREEN_SPREAD}
        by_gpu = sorted((g, timings[n], n) for n, g in gpu_ms.items() if g is not None)
        top += [n for _, _, n in by_gpu[:retime_top] if n not in top]
    # the simplest candidate (aten) always joins the final round: it is the baseline we must not lose to
    simplest = _baseline(timings, choices)
    if simplest not in top:
        top.append(simplest)
    if finalists is not None:
        finalists.extend(top)
    if len(top) > 1:
        with clock("final_round"):
            final = measure_together({n: fns[n] for n in top}, n_sets, device,
                                     config.bench_budget_ms * len(top))
        for n, t in final.items():
            details[n]["first_pass_ms"] = timings[n]
            details[n]["final_ms"] = t.median_ms
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
            gpu_ms.update({n: device_time_ms(fns[n], n_sets) for n, t in final_ms.items()
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


