"""The steady-regime duel on the caller's own calls (KERNELS_DUEL=calls, the default).

A call of 0.1 ms or more is finalized by a duel of aten (the baseline) and the first pass's fastest challenger in
~1 s windows, B C B, the first half of each untimed (kernels.measure.steady says why). Run inside the tune, that is
2-3 s of a synthetic loop per new problem, most of a large problem's tune: a llama layer's 12 problems took 31-35 s
to tune on an H200 (thirty-second session), and a model's first step waits for all of it. Here the tune ends after
its first pass, with the baseline as the winner and the challenger verified; the problem's next calls, the caller's
own, then run the same windows: the baseline for ~1 s, the challenger for ~1 s, the baseline again, each call in a
window's second half timed on the GPU (kernels.measure.call_timer), its result read back on a later call, so the
host never waits. The verdict is the loop's (kernels.tune.final_round.call_duel_result and record_duel), measured in
the regime the caller runs: its own power draw, its own neighbours in the stream. Until it is in, the caller gets
the baseline or a verified challenger within 10% of it in the first pass; after, the winner. The verdict is stored,
so later processes load it; a process that ends first leaves the duel to the next one (the selection, stored with
its challenger, is loaded, not tuned again).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from kernels.measure.call_timer import CallTimer
from kernels.measure.steady import plan_for

# A window ends once its wall time is up and it has timed at least MIN_TIMED calls (a problem called rarely keeps
# its window open until then). In its timed half, at most about MAX_TIMED calls are timed, spread over the half by a
# stride taken from the untimed half's count: a 0.2 ms call makes ~2,500 calls in half a second, and timing each one
# would hold as many CUDA events.
MIN_TIMED = 8
MAX_TIMED = 128


@dataclass(frozen=True)
class CallWindows:
    """The duel's windows on calls: wall seconds each, the leading fraction untimed, timed calls per window."""
    window_s: float
    settle_fraction: float
    min_timed: int = MIN_TIMED
    max_timed: int = MAX_TIMED


def windows_for(device: str) -> CallWindows:
    """The tune's steady plan as windows on calls (off the GPU a token one: MIN_TIMED calls a window)."""
    plan = plan_for(device)
    return CallWindows(plan.window_ms / 1e3, plan.settle_fraction)


class CallDuel:
    """A launcher serving one problem's calls from the baseline and a challenger in turn (B C B) until
    `decide(windows_ms, seconds)` names the winner (None: not yet), then from the winner alone. A challenger whose
    call raises loses at once (`fail(name, why)` names the winner) and the call is served by the baseline; the
    baseline's own errors are the caller's, raised as they are. Calls made under CUDA-graph capture
    (`capturing()`) get the baseline, untimed: events cannot be read back from a graph."""

    def __init__(self, baseline: str, challenger: str, launches: dict[str, Callable], *,
                 decide: Callable[[list[float], float], str | None], fail: Callable[[str, str], str],
                 timer: CallTimer, windows: CallWindows, capturing: Callable[[], bool] = lambda: False,
                 wall: Callable[[], float] = time.perf_counter):
        self.baseline, self.challenger = baseline, challenger
        self.order = (baseline, challenger, baseline)
        self.launches = launches
        self.final: Callable | None = None
        self.winner: str | None = None
        self._decide, self._fail, self._timer, self._windows = decide, fail, timer, windows
        self._capturing, self._wall = capturing, wall
        self._lock = threading.Lock()
        self._begun = wall()
        self._window = 0
        self._started: float | None = None
        self._calls = self._untimed = 0
        self._issued = [0] * len(self.order)
        self._sums = [0.0] * len(self.order)
        self._counts = [0] * len(self.order)
        self.windows_ms: list[float] = []

    def __call__(self, *args):
        final = self.final
        if final is not None:
            return final(*args)
        if self._capturing():
            return self.launches[self.baseline](*args)
        with self._lock:
            self._collect()
            final = self.final
            name, tag = (None, None) if final is not None else self._turn()
        if final is not None:
            return final(*args)
        launch = self.launches[name]
        try:
            if tag is None:
                return launch(*args)
            token = self._timer.start()
            result = launch(*args)
            self._timer.stop(token, tag)
            return result
        except Exception as e:
            if name == self.baseline:
                raise
            with self._lock:
                self._settle(self._fail(name, f"{type(e).__name__}: {str(e)[:300]}"))
            return self.launches[self.baseline](*args)

    def direct(self, *operands):
        """The call without `out` (the api's warm tables call launchers so: kernels.dispatch.api._two_arg)."""
        return self(*operands, None)

    def _turn(self) -> tuple[str, int | None]:
        """Which side serves this call, and its window's index when the call is timed (else None)."""
        now = self._wall()
        if self._window >= len(self.order):
            return self.baseline, None          # every window issued: the last ones are read back meanwhile
        if self._started is None:
            self._started = now
        elapsed = now - self._started
        if elapsed >= self._windows.window_s and self._issued[self._window] >= self._windows.min_timed:
            self._window += 1
            self._started, elapsed, self._calls, self._untimed = now, 0.0, 0, 0
            if self._window >= len(self.order):
                return self.baseline, None
        name = self.order[self._window]
        self._calls += 1
        if elapsed < self._windows.window_s * self._windows.settle_fraction:
            self._untimed += 1
            return name, None
        stride = max(1, self._untimed // self._windows.max_timed)
        if (self._calls - self._untimed - 1) % stride:
            return name, None
        self._issued[self._window] += 1
        return name, self._window

    def _collect(self) -> None:
        """Read back the timed calls that are done; ask for a verdict as each closed window completes."""
        for tag, ms in self._timer.done():
            self._sums[tag] += ms
            self._counts[tag] += 1
        grew = False
        while (len(self.windows_ms) < min(self._window, len(self.order))
               and self._counts[len(self.windows_ms)] == self._issued[len(self.windows_ms)]):
            i = len(self.windows_ms)
            self.windows_ms.append(self._sums[i] / self._counts[i])
            grew = True
        if grew:
            winner = self._decide(list(self.windows_ms), self._wall() - self._begun)
            if winner is not None:
                self._settle(winner)

    def _settle(self, winner: str) -> None:
        self.winner = winner
        self.final = self.launches[winner]
