"""The duel on the caller's calls (KERNELS_DUEL=calls): the CallDuel's windows on a fake wall clock and a fake GPU
timer, its verdict against the loop's (measure_duel on a fake chip), the tune's deferral, and the selection's
`duel` field as the stores read it back."""
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.core.choice import Choice
from kernels.core.selection import UNMEASURED, Selection
from kernels.dispatch.call_duel import NOT_YET, CallDuel, CallWindows, LateEntrants, windows_for
from kernels.measure.steady import SteadyPlan, measure_duel, steady_winner
from kernels.space.heuristics import GemmConfig
from kernels.store.schema import problems as selection_problems
from kernels.tune import final_round as fr
from tests.helpers import problem

ATEN = Choice("aten", "aten_mm", "bf16")
TMA = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 128, 64, 5, 4))
PLAN = SteadyPlan(heat_ms=0, window_ms=1000, rounds=1, settle_fraction=0.5)
WINDOWS = CallWindows(window_s=1.0, settle_fraction=0.5, min_timed=3, max_timed=4)


class Wall:
    """A wall clock the test moves: each call of the duel advances it by `step` seconds."""

    def __init__(self, step=0.05):
        self.now, self.step = 0.0, step

    def __call__(self):
        self.now += self.step
        return self.now


class FakeTimer:
    """A CallTimer whose calls take `ms[name]` (of the side that ran: the launch tells it) and whose results come back
    only when `release()` says (a GPU that runs behind the host)."""

    def __init__(self, held=False):
        self.held = held
        self.running: str | None = None
        self.ms: dict[str, float] = {}
        self._pending: list[tuple[int, float]] = []

    def start(self):
        return self.running

    def stop(self, token, tag):
        self._pending.append((tag, self.ms[token]))

    def done(self):
        if self.held:
            return []
        out, self._pending = self._pending, []
        return out


def _duel(ms, timer=None, windows=WINDOWS, wall=None, fails=(), capturing=lambda: False, challenger=TMA.name,
          late=None):
    """A CallDuel of aten and the tile whose launches record which side served; `ms`: name -> ms per call."""
    timer = timer or FakeTimer()
    timer.ms = ms
    served: list[str] = []
    verdicts: list[tuple] = []

    def launch(name):
        def run(*args):
            timer.running = name
            served.append(name)
            if name in fails:
                raise RuntimeError(f"{name} crashed")
            return name
        return run

    def decide(windows_ms, seconds):
        result = fr.call_duel_result(ATEN.name, TMA.name, windows_ms, PLAN, seconds)
        if result is None:
            return None
        winner, why = fr.record_duel(result, {}, {})
        verdicts.append((winner, why, list(windows_ms)))
        return winner

    def fail(name, why):
        verdicts.append((ATEN.name, why, None))
        return ATEN.name

    launches = {n: launch(n) for n in (ATEN.name, challenger) if n is not None}
    duel = CallDuel(ATEN.name, challenger, launches, decide=decide, fail=fail, timer=timer, windows=windows,
                    wall=wall or Wall(), capturing=capturing, late=late(launch) if late else None)
    return duel, served, verdicts


def _runs(served):
    """The sides in the order they served, consecutive calls of one side folded."""
    out = []
    for name in served:
        if not out or out[-1] != name:
            out.append(name)
    return out


def test_the_duel_runs_b_c_b_on_the_callers_calls_and_then_serves_the_winner():
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9})
    for _ in range(200):
        duel("a", "b")
        if verdicts:
            break
    assert verdicts and verdicts[0][0] == TMA.name          # 10% ahead in its window, aten even against itself
    assert _runs(served) == [ATEN.name, TMA.name, ATEN.name]
    assert verdicts[0][2] == pytest.approx([1.0, 0.9, 1.0])
    before = len(served)
    assert [duel("a", "b") for _ in range(5)] == [TMA.name] * 5    # the winner alone from then on
    assert served[before:] == [TMA.name] * 5


def test_a_challenger_slower_on_the_calls_loses_at_its_first_window():
    """C / B1 at or above first_window_bound: the baseline wins without its closing window (as in the loop)."""
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 1.02})
    for _ in range(200):
        duel()
        if verdicts:
            break
    assert verdicts[0][0] == ATEN.name and "closing window not run" in verdicts[0][1]
    assert len(verdicts[0][2]) == 2
    assert duel() == ATEN.name


def test_each_window_lasts_its_wall_time_with_the_first_half_untimed():
    wall = Wall(step=0.1)
    timer = FakeTimer(held=True)         # nothing comes back: the windows run on the clock alone
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, timer=timer, wall=wall)
    for _ in range(40):
        duel()
    runs = _runs(served)
    assert runs[:3] == [ATEN.name, TMA.name, ATEN.name]
    # ~1 s a window at 0.1 s a call: 10-11 calls each, of which the second half (5-6) is timed
    first = served.index(TMA.name)
    assert 10 <= first <= 12
    assert 4 <= sum(1 for tag, _ in timer._pending if tag == 0) <= 6


def test_a_window_stays_open_until_it_has_timed_its_minimum():
    """A problem called rarely: the wall time is long past, but the window needs min_timed timed calls."""
    wall = Wall(step=5.0)
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, wall=wall)
    for _ in range(4):
        duel()
    assert served == [ATEN.name] * 4           # the first call opens it, then three timed calls
    duel()
    assert served[-1] == TMA.name


def test_the_timed_half_is_sampled_by_a_stride_from_the_untimed_count():
    windows = CallWindows(window_s=1.0, settle_fraction=0.5, min_timed=1, max_timed=4)
    timer = FakeTimer(held=True)
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, timer=timer, windows=windows, wall=Wall(step=0.01))
    for _ in range(100):                     # 1 s of calls at 10 ms: ~50 untimed, then a stride of 12
        duel()
    timed = [tag for tag, _ in timer._pending if tag == 0]
    assert 3 <= len(timed) <= 6


def test_no_verdict_until_the_gpu_has_handed_back_the_windows():
    timer = FakeTimer(held=True)
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9}, timer=timer)
    for _ in range(200):
        duel()
    assert not verdicts and served[-1] == ATEN.name     # every window issued: the baseline serves meanwhile
    timer.held = False
    duel()
    assert verdicts and verdicts[0][0] == TMA.name


def test_a_challenger_that_raises_on_a_call_loses_and_the_call_is_served():
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9}, fails={TMA.name})
    results = [duel() for _ in range(60)]
    assert all(r == ATEN.name for r in results)
    assert verdicts[0][0] == ATEN.name and "crashed" in verdicts[0][1]
    assert served.count(TMA.name) == 1


def test_the_baselines_own_error_is_the_callers():
    duel, _, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, fails={ATEN.name})
    with pytest.raises(RuntimeError, match="aten_mm crashed"):
        duel()


def test_calls_under_capture_get_the_baseline_untimed():
    timer = FakeTimer()
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9}, timer=timer, capturing=lambda: True)
    for _ in range(100):
        duel()
    assert set(served) == {ATEN.name} and not timer._pending and not verdicts


def test_windows_for_the_gpu_are_the_loops_plan():
    gpu = windows_for("cuda")
    plan = fr.plan_for("cuda")
    assert (gpu.window_s * 1e3, gpu.settle_fraction) == (plan.window_ms, plan.settle_fraction)
    assert windows_for("cpu").window_s == 0.0


class WindowChip:
    """A WindowClock handing out given window values in order (for measure_duel)."""

    def __init__(self, values):
        self.values = list(values)

    def __call__(self, name, untimed, timed):
        value = self.values.pop(0)
        return lambda: value


@settings(max_examples=200, deadline=None)
@given(b1=st.floats(0.5, 2.0), c=st.floats(0.8, 1.2), b2=st.floats(0.9, 1.1))
def test_the_verdict_on_calls_is_the_loops_for_the_same_windows(b1, c, b2):
    windows = [b1, b1 * c, b1 * b2]
    loop = measure_duel(WindowChip(windows), {ATEN.name: b1, TMA.name: b1 * c}, ATEN.name, TMA.name, PLAN,
                        hopeless=fr._hopeless)
    loop_winner, _, _ = steady_winner(loop, fr.ONE_ROUND_FLOOR)
    calls = fr.call_duel_result(ATEN.name, TMA.name, windows[:2], PLAN)
    if calls is None:
        calls = fr.call_duel_result(ATEN.name, TMA.name, windows, PLAN)
    assert calls.stopped_early == loop.stopped_early
    assert fr.record_duel(calls, {}, {})[0] == loop_winner


def test_a_window_of_zero_decides_nothing():
    assert fr.call_duel_result(ATEN.name, TMA.name, [0.0, 1.0, 1.0], PLAN) is None


# -- the tune's deferral -----------------------------------------------------------------------------------------
def test_a_deferred_steady_round_runs_no_window_and_names_its_challenger():
    ran = []

    def windows(fns):
        ran.append(fns)
        raise AssertionError("a deferred duel runs no window")

    timings = {ATEN.name: 0.59, TMA.name: 0.57}
    details = {n: {} for n in timings}
    notes: list[str] = []
    deferred: list[str] = []
    winner, regime, finalists = fr.pick_winner(timings, {ATEN.name: ATEN, TMA.name: TMA}, {n: n for n in timings}, 1,
                                               "cuda", details, notes, windows=windows, deferred=deferred)
    assert (winner, regime, deferred, ran) == (ATEN.name, "steady", [TMA.name], [])
    assert sorted(finalists) == sorted([ATEN.name, TMA.name])
    assert "duels aten_mm on the caller's calls" in notes[-1]
    assert timings == {ATEN.name: 0.59, TMA.name: 0.57}        # first-pass times until the duel's are in


def test_a_deferred_duel_verifies_its_challenger_first():
    timings = {ATEN.name: 0.59, TMA.name: 0.57}
    deferred: list[str] = []
    checked = []

    def check(name):
        checked.append(name)
        if name == TMA.name:
            timings.pop(name)
            return False
        return True

    winner, _, finalists = fr.pick_winner(timings, {ATEN.name: ATEN, TMA.name: TMA}, {n: n for n in timings}, 1,
                                          "cuda", {n: {} for n in timings}, [], windows=lambda f: None, check=check,
                                          deferred=deferred)
    assert (winner, finalists, deferred) == (ATEN.name, [ATEN.name], [])
    assert checked == [ATEN.name, TMA.name]


# -- the selection's field -----------------------------------------------------------------------------------------
def _pending_selection(**changes):
    sel = Selection(problem=problem(), winner=ATEN.name, choices={ATEN.name: ATEN, TMA.name: TMA},
                    timings={ATEN.name: 0.59, TMA.name: 0.57}, regime="steady", duel=TMA.name)
    data = json.loads(json.dumps(sel.to_dict()))        # as the store reads it back
    data.update(changes)
    return data


def test_a_pending_duel_round_trips_and_the_schema_checks_it():
    data = _pending_selection()
    assert selection_problems(data) is None
    back = Selection.from_dict(data, "disk")
    assert back.duel == TMA.name
    assert "runs on this problem's calls" in back.table()
    assert selection_problems(_pending_selection(duel=ATEN.name)) is not None          # the winner itself
    assert selection_problems(_pending_selection(duel="triton_nope")) is not None      # not a recorded choice
    assert selection_problems(_pending_selection(regime="burst")) is not None          # only steady problems duel
    assert selection_problems(_pending_selection(duel=7)) is not None
    data = _pending_selection()
    data["timings"][TMA.name] = "crashed"
    assert selection_problems(data) is not None                                        # not a timed challenger
    with pytest.raises(ValueError, match="duel"):
        Selection.from_dict(_pending_selection(duel=ATEN.name), "disk")
    assert Selection.from_dict({k: v for k, v in _pending_selection().items() if k != "duel"}, "disk").duel is None


# -- faults and the warm path ------------------------------------------------------------------------------------
def test_a_baseline_error_on_a_timed_call_does_not_wedge_the_duel():
    """The error is the caller's (raised as it is), and its call never comes back from the timer: the window must not
    wait for it (it did: issued 5, read 4, no verdict ever)."""
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9})
    real = duel.launches[ATEN.name]
    raised = []

    def flaky(*args):
        if len(served) == 12 and not raised:        # a timed call of the first window (the second half)
            raised.append(True)
            served.append(ATEN.name)
            raise MemoryError("out of memory")
        return real(*args)

    duel.launches[ATEN.name] = flaky
    duel._directs[ATEN.name] = None
    for _ in range(300):
        try:
            duel()
        except MemoryError:
            pass
        if verdicts:
            break
    assert raised and verdicts and verdicts[0][0] == TMA.name


def test_calls_under_capture_tell_the_caller_once_per_call():
    told = []
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, capturing=lambda: True)
    duel._on_capture = lambda: told.append(1)
    duel()
    duel()
    assert told == [1, 1] and served == [ATEN.name, ATEN.name]


def test_the_direct_call_runs_each_sides_own_direct_launch():
    """The warm path calls launchers without `out` through their `.direct` (torch.mm itself, a native launch): the
    duel times those, not the Python launch around them."""
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9})
    direct_calls = []

    def aten_direct(a, b):
        direct_calls.append((a, b))
        return "direct"

    duel._directs[ATEN.name] = aten_direct
    assert duel.direct("a", "b") == "direct" and direct_calls == [("a", "b")]
    assert duel._side(TMA.name, True)("a", "b") == TMA.name        # no .direct: the launch with out=None


def test_a_verdict_found_while_another_call_judges_is_judged_by_a_later_call():
    """Two threads: the one that judges [B1, C] (undecided) must not swallow B2's completion."""
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.995})
    duel._deciding = True                     # as if another thread were judging, for the whole duel
    for _ in range(200):
        duel()
    assert not verdicts
    duel._deciding = False
    duel()
    assert verdicts and verdicts[0][0] == ATEN.name and len(verdicts[0][2]) == 3


def test_a_verdict_replaces_whichever_pending_selection_memory_holds_and_the_duels_launchers():
    """A second device's lookup made its own pending Selection object: the first device's verdict must still
    replace it (else duels_pending and the grad routes follow a duel nothing runs)."""
    from kernels.dispatch import selected

    p = problem()
    first = Selection.from_dict(_pending_selection(), "tuned")
    second = Selection.from_dict(_pending_selection(), "disk")
    duel = type("Duel", (), {"launches": {ATEN.name: "aten launch", TMA.name: "tma launch"}})()
    told = []

    def tell():
        told.append(1)

    selected.on_duel_settled(tell)
    with selected.lock:
        selected._selections[p] = second
        selected._launchers[(p, 0)] = duel
        selected._launchers[(p, 1)] = "another device's own"
    decided = selected._decided_copy(first)
    decided.winner = TMA.name
    selected._keep(p, duel, decided)
    assert selected.selection(p) is decided and selected.duels_pending() == 0
    assert selected._launchers[(p, 0)] == "tma launch" and selected._launchers[(p, 1)] == "another device's own"
    selected._on_settled.remove(tell)
    assert told and decided.created > first.created


# -- late entrants: candidates the isolated child measures once it is up ------------------------------------------
class Entrants:
    """LateEntrants whose readiness the test sets; join() hands back the tile (or `joins`' answer)."""

    def __init__(self, joins=TMA.name, raises=False):
        self.up, self.joined, self.joins, self.raises = False, 0, joins, raises

    def __call__(self, launch):
        def join():
            self.joined += 1
            if self.raises:
                raise RuntimeError("the child is gone")
            return None if self.joins is None else (self.joins, launch(self.joins))
        return LateEntrants(ready=lambda: self.up, join=join)


def test_late_entrants_the_baseline_serves_untimed_until_they_join_then_the_windows_start():
    entrants = Entrants()
    timer = FakeTimer()
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9}, timer=timer, challenger=None, late=entrants)
    for _ in range(50):
        assert duel("a", "b") == ATEN.name
    assert entrants.joined == 0 and not timer._pending and duel.winner is None
    entrants.up = True
    for _ in range(300):
        duel()
        if verdicts:
            break
    assert entrants.joined == 1 and duel.challenger == TMA.name
    assert verdicts and verdicts[0][0] == TMA.name and verdicts[0][2] == pytest.approx([1.0, 0.9, 1.0])
    assert _runs(served[50:]) == [ATEN.name, TMA.name, ATEN.name]


def test_late_entrants_that_bring_no_challenger_leave_the_baseline_the_winner():
    entrants = Entrants(joins=None)
    duel, served, verdicts = _duel({ATEN.name: 1.0, TMA.name: 0.9}, challenger=TMA.name, late=entrants)
    entrants.up = True
    assert duel() == ATEN.name and duel.winner == ATEN.name and entrants.joined == 1
    assert [duel() for _ in range(20)] == [ATEN.name] * 20 and TMA.name not in served and not verdicts


def test_a_join_that_raises_leaves_the_baseline_serving_and_the_call_goes_on():
    entrants = Entrants(raises=True)
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, challenger=None, late=entrants)
    entrants.up = True
    assert duel() == ATEN.name and duel.winner == ATEN.name
    assert [duel() for _ in range(5)] == [ATEN.name] * 5 and entrants.joined == 1


def test_no_join_under_capture():
    entrants = Entrants()
    capturing = [True]
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, challenger=None, late=entrants,
                            capturing=lambda: capturing[0])
    entrants.up = True
    assert duel() == ATEN.name and entrants.joined == 0
    capturing[0] = False
    duel()
    assert entrants.joined == 1


def test_while_one_call_joins_the_others_get_the_baseline_and_join_nothing():
    gate, inside = threading.Event(), threading.Event()
    entrants = Entrants()

    def slow(launch):
        plain = entrants(launch)

        def join():
            inside.set()
            gate.wait(10)
            return plain.join()
        return LateEntrants(ready=plain.ready, join=join)
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, challenger=None, late=slow)
    entrants.up = True
    worker = threading.Thread(target=duel)
    worker.start()
    assert inside.wait(10)
    assert [duel() for _ in range(5)] == [ATEN.name] * 5        # not blocked behind the join
    gate.set()
    worker.join(10)
    assert entrants.joined == 1 and duel.challenger == TMA.name


def test_a_duel_needs_a_challenger_or_late_entrants():
    with pytest.raises(ValueError, match="challenger"):
        CallDuel(ATEN.name, None, {ATEN.name: lambda: 0}, decide=lambda w, s: None, fail=lambda n, w: ATEN.name,
                 timer=FakeTimer(), windows=WINDOWS)


def test_unmeasured_candidates_round_trip_and_the_schema_checks_them():
    cutlass = Choice("cutlass", "cutlass3x_sm90_mm", "bf16", GemmConfig(128, 256, 64, 4, 8))
    choices = {ATEN.name: ATEN, TMA.name: TMA, cutlass.name: cutlass}
    sel = Selection(problem=problem(), winner=ATEN.name, choices=choices,
                    timings={ATEN.name: 0.59, TMA.name: 0.57, cutlass.name: f"{UNMEASURED}: the child was starting"},
                    regime="steady", duel=TMA.name, unmeasured=[cutlass.name])
    data = json.loads(json.dumps(sel.to_dict()))
    assert selection_problems(data) is None
    back = Selection.from_dict(data, "disk")
    assert back.unmeasured == [cutlass.name] and back.awaiting_calls
    assert cutlass.name not in back.failures() and "measured on this problem's calls" in back.table()
    for bad in ([ATEN.name], [TMA.name], ["cutlass_nope"], [7], cutlass.name, [cutlass.name] * 2):
        assert selection_problems({**data, "unmeasured": bad}) is not None, bad
    assert selection_problems({**data, "regime": "burst", "duel": None}) is not None
    timed = {**data, "timings": {**data["timings"], cutlass.name: 0.5}}
    assert selection_problems(timed) is not None                    # a measured candidate is not unmeasured
    with pytest.raises(ValueError, match="unmeasured"):
        Selection.from_dict({**data, "unmeasured": [ATEN.name]}, "disk")
    with pytest.raises(ValueError, match="twice"):
        Selection.from_dict({**data, "unmeasured": [cutlass.name] * 2}, "disk")
    assert selection_problems({**data, "pending": [cutlass.name] * 2}) is not None
    assert not Selection.from_dict({**data, "unmeasured": [], "duel": None}, "disk").awaiting_calls


def test_a_join_that_is_not_ready_after_all_is_asked_again():
    entrants = Entrants()
    answers = [NOT_YET]

    def late(launch):
        plain = entrants(launch)
        return LateEntrants(ready=plain.ready, join=lambda: answers.pop(0) if answers else plain.join())
    duel, served, _ = _duel({ATEN.name: 1.0, TMA.name: 0.9}, challenger=None, late=late)
    entrants.up = True
    assert duel() == ATEN.name and duel.winner is None and duel.challenger is None
    duel()
    assert duel.challenger == TMA.name and entrants.joined == 1
