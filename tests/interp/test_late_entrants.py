"""A process's first tune does not wait for the isolated child's start: in the steady regime with the duel on calls,
the candidates the child measures are left to the problem's calls (Selection.unmeasured); aten serves until the
child is up, the call after that has them measured there, the fastest verified candidate duels aten on the next
calls, and the stores hold each step. Through the interpreter, with the one Triton tile KERNELS_ONLY leaves made an
isolated candidate and the steady regime forced (a CPU problem is never there)."""
import functools
import subprocess
import sys
import time

import pytest
import torch

import kernels
from backends import child_handle, get_backend
from backends.triton import TritonBackend
from kernels.core.problem import GemmProblem
from kernels.core.selection import UNMEASURED
from kernels.dispatch import selected
from kernels.dispatch.call_duel import CallDuel
from kernels.tune import autotune
from kernels.tune import final_round as fr


def _flat(fns):
    """A WindowClock reading 1 ms for every window (the loop's duel then keeps aten)."""
    return lambda name, untimed, timed: (lambda: 1.0)


class ChildStart:
    """backends.child_handle.start_state, held at "starting" until `open()`; then the real answer."""

    def __init__(self):
        self.held, self.asked = True, 0
        self.real = child_handle.start_state

    def __call__(self, device=None):
        self.asked += 1
        return "starting" if self.held else self.real(device)

    def open(self):
        self.held = False
        child_handle.prestart(None)
        assert child_handle.warmed() == "done"


@pytest.fixture
def late(monkeypatch):
    """fp32 16x16x16 on CPU in the steady regime; the tile isolated; the child held at its start."""
    child_handle.close()
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    p = GemmProblem.from_tensors("mm", a, b)
    tile = next(c.name for c in get_backend("triton").choices(p, "default")[0] if c.template == "triton_mm")
    kernels.config.only = f"^{tile}$"
    kernels.config.backends = "aten,triton"
    monkeypatch.setattr(TritonBackend, "isolated", True)
    monkeypatch.setattr(autotune, "select", functools.partial(fr.select, windows=_flat))
    monkeypatch.setattr(fr, "CHALLENGER_WITHIN", 1e9)
    start = ChildStart()
    monkeypatch.setattr(child_handle, "start_state", start)
    yield a, b, p, tile, start
    child_handle.close()


def _call_until(a, b, p, done, limit=400):
    for i in range(limit):
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-4)
        if done(selected.selection(p)):
            return i + 1
    raise AssertionError("never got there")


def test_the_first_tune_leaves_the_childs_candidates_to_the_calls_which_measure_and_duel_them(late):
    a, b, p, tile, start = late
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert (sel.winner, sel.duel, sel.unmeasured, sel.regime) == ("aten_mm", None, [tile], "steady")
    assert sel.timings[tile].startswith(UNMEASURED) and sel.awaiting_calls
    assert isinstance(selected.resolved(p), CallDuel) and kernels.stats()["duels_pending"] == 1
    for _ in range(5):                       # the child still starting: aten serves, nothing is measured
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-4)
    assert selected.selection(p).unmeasured == [tile]
    start.open()
    _call_until(a, b, p, lambda s: not s.unmeasured)
    joined = selected.selection(p)
    assert joined.duel == tile and joined.details[tile]["measured_in"] == "child"
    assert isinstance(joined.timings[tile], float) and "measured in the isolated child" in joined.notes[-1]
    stored = selected._store.get(selected.store_key(p, autotune.fingerprint(kernels.config.backends)))
    assert (stored.duel, stored.unmeasured) == (tile, [])        # a process ending now leaves the duel, not this
    _call_until(a, b, p, lambda s: not s.awaiting_calls)
    decided = selected.selection(p)
    assert decided.winner == "aten_mm" and "on the caller's calls" in decided.notes[-1]
    assert kernels.stats()["duels_pending"] == 0


def test_a_stored_selection_with_unmeasured_candidates_is_resumed_not_tuned_again(late):
    a, b, p, tile, start = late
    kernels.mm(a, b)
    kernels.clear_memory_cache()             # the process ended before the child was up
    tunes = kernels.stats()["tunes"]
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert (sel.source, sel.unmeasured) == ("disk", [tile]) and isinstance(selected.resolved(p), CallDuel)
    start.open()
    _call_until(a, b, p, lambda s: not s.awaiting_calls)
    assert kernels.stats()["tunes"] == tunes and selected.selection(p).details[tile]["measured_in"] == "child"


def test_with_the_child_up_the_tune_measures_its_candidates_itself(late):
    a, b, p, tile, start = late
    start.open()
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert sel.unmeasured == [] and sel.duel == tile and sel.details[tile]["measured_in"] == "child"


def test_loop_mode_and_burst_problems_wait_for_the_child(late, monkeypatch):
    a, b, p, tile, start = late
    kernels.config.duel = "loop"
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert sel.unmeasured == [] and sel.details[tile]["measured_in"] == "child" and start.asked == 0
    kernels.clear_memory_cache()
    kernels.config.duel = "calls"
    monkeypatch.setattr(autotune, "select", fr.select)          # a CPU problem: the burst rules
    a2, b2 = torch.randn(16, 32), torch.randn(32, 16)
    kernels.mm(a2, b2)
    assert kernels.explain(a2, b2).unmeasured == [] and start.asked == 0


def test_a_child_that_dies_at_the_join_leaves_aten_serving(late, monkeypatch):
    a, b, p, tile, start = late
    kernels.mm(a, b)
    start.open()
    monkeypatch.setattr("backends.isolated_child.FAULT_INJECTION", tile)    # the child SIGSEGVs on the tile
    _call_until(a, b, p, lambda s: not s.awaiting_calls)
    sel = selected.selection(p)
    assert sel.winner == "aten_mm" and sel.duel is None and sel.timings[tile].startswith("crashed")


_popen = subprocess.Popen


def _child_runs(monkeypatch, replacement):
    """The isolated child's command replaced: by a script (`-c`), or by an exception its start raises."""
    def popen(args, *a, **k):
        if list(args[1:3]) == ["-m", "backends.isolated_child"]:
            if isinstance(replacement, BaseException):
                raise replacement
            args = [sys.executable, "-c", replacement]
        return _popen(args, *a, **k)
    monkeypatch.setattr(subprocess, "Popen", popen)


@pytest.fixture
def real_start(late, monkeypatch):
    """`late` with the real start_state (the child's start is what the test replaces)."""
    monkeypatch.setattr(child_handle, "start_state", late[4].real)
    return late


def _tunes_again(a, b) -> bool:
    """Whether a fresh lookup (another process) tunes the problem again."""
    kernels.clear_memory_cache()
    tunes = kernels.stats()["tunes"]
    kernels.mm(a, b)
    return kernels.stats()["tunes"] > tunes


def test_a_child_that_cannot_be_started_fails_its_candidates_and_the_call_is_served(real_start, monkeypatch):
    a, b, p, tile, _ = real_start
    _child_runs(monkeypatch, OSError(24, "Too many open files"))
    assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-4)      # served, whatever the child does
    sel = selected.selection(p)
    assert sel.pending == [] and sel.unmeasured == [] and not sel.awaiting_calls
    assert sel.timings[tile].startswith("not measured: failed: the isolated child could not be started (OSError")
    assert sel.unavailable == []          # the child's fault, not the backend's: no re-tune for that
    assert not _tunes_again(a, b)         # stored as a failure, as a child dying in a tune is: no re-tune loop


def test_a_child_that_dies_or_cannot_restart_while_the_calls_wait_fails_them_and_the_calls_go_on(real_start,
                                                                                                    monkeypatch):
    a, b, p, tile, _ = real_start
    _child_runs(monkeypatch, "import time; time.sleep(60)")         # never answers its warm-up
    kernels.mm(a, b)
    assert selected.selection(p).unmeasured == [tile]
    with child_handle.lock:
        child_handle.discard(kill=True)                             # gone; and no new one can start
    _child_runs(monkeypatch, OSError(12, "Cannot allocate memory"))
    _call_until(a, b, p, lambda s: not s.awaiting_calls, limit=5)
    sel = selected.selection(p)
    assert sel.pending == [] and sel.winner == "aten_mm" and "could not be started" in sel.timings[tile]
    stored = selected._store.get(selected.store_key(p, autotune.fingerprint(kernels.config.backends)))
    assert not stored.awaiting_calls and stored.timings[tile] == sel.timings[tile]
    assert not _tunes_again(a, b)


def test_a_child_whose_start_hangs_is_ended_after_the_limit_and_the_calls_go_on(real_start, monkeypatch):
    a, b, p, tile, _ = real_start
    monkeypatch.setattr(child_handle, "START_LIMIT_S", 1.0)
    _child_runs(monkeypatch, "import time; time.sleep(60)")
    kernels.mm(a, b)
    hung = child_handle.current()
    assert selected.selection(p).unmeasured == [tile] and hung is not None
    start = time.perf_counter()
    while selected.selection(p).awaiting_calls and time.perf_counter() - start < 20:
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-4)
    sel = selected.selection(p)
    assert not sel.awaiting_calls and sel.pending == [] and "did not come up within 1 s" in sel.timings[tile]
    assert hung.proc.poll() is not None                             # ended, not left behind


def test_a_clear_during_the_join_brings_no_pending_selection_back(late, monkeypatch):
    a, b, p, tile, start = late
    kernels.mm(a, b)
    real = selected.join_unmeasured

    def join(*args):
        kernels.clear_memory_cache()          # another thread: a settings change
        return real(*args)
    monkeypatch.setattr(selected, "join_unmeasured", join)
    start.open()
    kernels.mm(a, b)
    assert selected.selection(p) is None and kernels.stats()["duels_pending"] == 0


def test_a_stored_entry_whose_unmeasured_binaries_are_missing_is_tuned_again_once_built(late, monkeypatch):
    a, b, p, tile, start = late
    kernels.mm(a, b)
    kernels.clear_memory_cache()
    real_build = TritonBackend.build
    monkeypatch.setattr(TritonBackend, "build", lambda self, problem, choices: [])       # nothing loads here
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert (sel.unmeasured, sel.pending) == ([], [tile]) and not sel.awaiting_calls
    monkeypatch.setattr(TritonBackend, "build", real_build)
    kernels.clear_memory_cache()
    start.open()
    with pytest.warns(UserWarning, match="re-tuning"):
        kernels.mm(a, b)                      # pending and settled (built): tuned again, the child up
    again = selected.selection(p)
    assert again.pending == [] and again.details[tile]["measured_in"] == "child"


def test_the_joined_challenger_is_verified_in_the_caller_before_it_duels(late, monkeypatch):
    """The child verified its own load; the launch that would run here is checked here too, as a stored challenger
    is. One that fails there never serves a call."""
    a, b, p, tile, start = late
    kernels.mm(a, b)
    monkeypatch.setattr(selected, "verify", lambda launch, problem: "wrong result: planted")
    start.open()
    _call_until(a, b, p, lambda s: not s.awaiting_calls, limit=5)
    sel = selected.selection(p)
    assert sel.winner == "aten_mm" and sel.duel is None
    assert sel.timings[tile] == "failed verification in the caller: wrong result: planted"
    assert not isinstance(selected.resolved(p), CallDuel)


def test_cache_list_and_explain_name_what_awaits_the_calls(late):
    from kernels.store import cache_admin

    a, b, p, tile, start = late
    kernels.mm(a, b)
    assert any("1 candidate(s) to measure on calls, then a duel)" in line for line in cache_admin.list_lines())
    assert tile in kernels.explain(a, b).table()


def test_a_check_in_the_caller_that_cannot_run_keeps_the_outcome_in_this_process(late, monkeypatch):
    """Its call failing (memory it could not get) is not a wrong result: nothing of it is stored, and the next
    process joins the candidates again."""
    a, b, p, tile, start = late
    kernels.mm(a, b)
    monkeypatch.setattr(selected, "verify", lambda launch, problem: "crashed: OutOfMemoryError: planted")
    start.open()
    _call_until(a, b, p, lambda s: not s.awaiting_calls, limit=5)
    assert selected.selection(p).timings[tile].startswith("failed verification in the caller: crashed")
    stored = selected._store.get(selected.store_key(p, autotune.fingerprint(kernels.config.backends)))
    assert stored.unmeasured == [tile]


def test_a_clear_during_a_join_that_finds_no_challenger_brings_nothing_back(late, monkeypatch):
    a, b, p, tile, start = late
    kernels.mm(a, b)
    real = selected.join_unmeasured

    def join(*args):
        kernels.clear_memory_cache()
        return real(*args)
    monkeypatch.setattr(selected, "join_unmeasured", join)
    monkeypatch.setattr(selected, "verify", lambda launch, problem: "wrong result: planted")     # no duel follows
    start.open()
    kernels.mm(a, b)
    assert selected.selection(p) is None and kernels.stats()["duels_pending"] == 0


def test_a_child_gone_between_ready_and_join_is_waited_for_again(late, monkeypatch):
    """Another thread ended the child after this call saw it up: the join asks again later rather than start a
    child inside the caller's call."""
    a, b, p, tile, start = late
    kernels.mm(a, b)
    start.open()
    gone = [True]
    real = child_handle.serving
    monkeypatch.setattr(child_handle, "serving", lambda: False if gone[0] else real())
    kernels.mm(a, b)
    assert selected.selection(p).unmeasured == [tile] and isinstance(selected.resolved(p), CallDuel)
    gone[0] = False
    _call_until(a, b, p, lambda s: not s.unmeasured, limit=5)
    assert selected.selection(p).details[tile]["measured_in"] == "child"
