"""A process's first tune does not wait for the isolated child's start: in the steady regime with the duel on calls,
the candidates the child measures are left to the problem's calls (Selection.unmeasured); aten serves until the
child is up, the call after that has them measured there, the fastest verified candidate duels aten on the next
calls, and the stores hold each step. Through the interpreter, with the one Triton tile KERNELS_ONLY leaves made an
isolated candidate and the steady regime forced (a CPU problem is never there)."""
import functools

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
    """backends.child_handle.is_up, held at "still starting" until `open()`; then the real answer."""

    def __init__(self):
        self.held, self.asked = True, 0
        self.real = child_handle.is_up

    def __call__(self, device=None):
        self.asked += 1
        return False if self.held else self.real(device)

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
    monkeypatch.setattr(child_handle, "is_up", start)
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
