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


# What a join returns when the entrants turned out not to be ready after all: the duel waits on, asking again
NOT_YET = object()


@dataclass(frozen=True)
class LateEntrants:
    """Candidates still to be measured elsewhere before the duel can start (the isolated child, still starting when
    the problem was tuned): `ready()` says, without waiting, whether they can be now; `join()` measures them (the
    call that runs it waits that long) and returns the duel's challenger and its launch, None when none came within
    reach (the baseline has then won), or NOT_YET."""
    ready: Callable[[], bool]
    join: Callable[[], tuple[str, Callable] | None]


class CallDuel:
    """A launcher serving one problem's calls from the baseline and a challenger in turn (B C B) until
    `decide(windows_ms, seconds)` names the winner (None: not yet), then from the winner alone. A challenger whose
    call raises loses at once (`fail(name, why)` names the winner) and the call is served by the baseline; the
    baseline's own errors are the caller's, raised as they are. Calls made under CUDA-graph capture (`capturing()`)
    get the baseline, untimed (events cannot be read back from a graph), and `on_capture()` is told: the graph keeps
    the baseline whatever the verdict. With `late` entrants, the baseline serves untimed until they are ready; the
    first call after that joins them (they may replace `challenger`, or leave none), and the windows start then."""

    def __init__(self, baseline: str, challenger: str | None, launches: dict[str, Callable], *,
                 decide: Callable[[list[float], float], str | None], fail: Callable[[str, str], str],
                 timer: CallTimer, windows: CallWindows, capturing: Callable[[], bool] = lambda: False,
                 on_capture: Callable[[], None] = lambda: None, wall: Callable[[], float] = time.perf_counter,
                 late: LateEntrants | None = None):
        if challenger is None and late is None:
            raise ValueError("a duel needs a challenger, or late entrants to find one")
        self.baseline, self.challenger = baseline, challenger
        self.order = (baseline, challenger, baseline)
        self.launches = dict(launches)
        # each side's call without `out` as the warm path makes it (`.direct`: torch's own function, a native
        # launch), so that the duel times what the winner will run
        self._directs = {n: getattr(launch, "direct", None) for n, launch in self.launches.items()}
        self.final: Callable | None = None
        self.winner: str | None = None
        self._decide, self._fail, self._timer, self._windows = decide, fail, timer, windows
        self._capturing, self._on_capture, self._wall = capturing, on_capture, wall
        self._late = late
        self._joining = False
        self._lock = threading.Lock()
        self._deciding = False
        self._judged = 0              # windows a verdict was asked for
        self._begun = wall()
        self._window = 0
        self._started: float | None = None
        self._calls = self._untimed = 0
        self._issued = [0] * len(self.order)
        self._sums = [0.0] * len(self.order)
        self._counts = [0] * len(self.order)
        self.windows_ms: list[float] = []

    def __call__(self, *args):
        return self._serve(args, False)

    def direct(self, *operands):
        """The call without `out` (the api's warm tables call launchers so: kernels.dispatch.api._two_arg)."""
        return self._serve(operands, True)

    def _side(self, name: str, direct: bool) -> Callable:
        if not direct:
            return self.launches[name]
        fn = self._directs[name]
        if fn is not None:
            return fn
        launch = self.launches[name]
        return lambda *operands: launch(*operands, None)

    def _serve(self, args: tuple, direct: bool):
        if self.winner is not None:
            return self._side(self.winner, direct)(*args)
        if self._capturing():
            self._on_capture()
            return self._side(self.baseline, direct)(*args)
        if self._late is not None:
            self._await_entrants()
            if self._late is not None or self.winner is not None:
                return self._side(self.winner or self.baseline, direct)(*args)
        with self._lock:
            windows = self._collect()
            name, tag = (self.winner, None) if self.winner is not None else self._turn()
        if windows is not None:
            self._judge(windows)
        launch = self._side(name, direct)
        try:
            if tag is None:
                return launch(*args)
            token = self._timer.start()
            result = launch(*args)
            self._timer.stop(token, tag)
            return result
        except BaseException as e:
            if tag is not None:
                with self._lock:       # never read back: its window must not wait for it
                    self._issued[tag] -= 1
            if name != self.challenger or not isinstance(e, Exception):
                raise
            with self._lock:
                if self.winner is None:
                    self.winner = self._fail(name, f"{type(e).__name__}: {str(e)[:300]}")
            return self._side(self.baseline, direct)(*args)

    def _await_entrants(self) -> None:
        """Join the late entrants once they are ready, on this call (one call at a time; the others meanwhile get
        the baseline)."""
        with self._lock:
            if self._joining or self._late is None:
                return
            try:
                if not self._late.ready():
                    return
            except Exception:  # noqa: BLE001 - the join then finds out why, and records it
                pass
            self._joining = True
        joined = None
        try:
            joined = self._late.join()
        except Exception:  # noqa: BLE001 - a join records its own faults; the caller's call goes on regardless
            joined = None
        finally:
            with self._lock:
                self._joining = False
                if joined is not NOT_YET:
                    self._joined(joined)

    def _joined(self, joined: tuple[str, Callable] | None) -> None:
        """The join's outcome (hold the lock): the challenger the windows start with, or none (or a join that
        raised): the baseline has won."""
        self._late = None
        if self.winner is None and joined is None:
            self.winner = self.baseline
        elif self.winner is None:
            name, launch = joined
            self.challenger, self.order = name, (self.baseline, name, self.baseline)
            self.launches[name] = launch
            self._directs[name] = getattr(launch, "direct", None)
            self._begun = self._wall()

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

    def _collect(self) -> list[float] | None:
        """Read back the timed calls that are done; the windows so far when one more has completed since the last
        verdict asked and no other call is asking (this call then asks, outside the lock), else None."""
        for tag, ms in self._timer.done():
            self._sums[tag] += ms
            self._counts[tag] += 1
        while len(self.windows_ms) < min(self._window, len(self.order)):
            i = len(self.windows_ms)
            if self._counts[i] != self._issued[i] or self._counts[i] == 0:
                break
            self.windows_ms.append(self._sums[i] / self._counts[i])
        if len(self.windows_ms) <= self._judged or self._deciding:
            return None
        self._deciding, self._judged = True, len(self.windows_ms)
        return list(self.windows_ms)

    def _judge(self, windows: list[float]) -> None:
        """Ask for a verdict (which may write to the stores: never under the lock)."""
        try:
            winner = self._decide(windows, self._wall() - self._begun)
        finally:
            with self._lock:
                self._deciding = False
        if winner is not None:
            with self._lock:
                if self.winner is None:
                    self.winner = winner
