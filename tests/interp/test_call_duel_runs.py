"""The duel on calls end to end through the interpreter: kernels.mm's tune defers its steady duel, the problem's next
calls run it, the verdict is stored and read back by a fresh lookup; a stored pending duel is resumed, not re-tuned;
KERNELS_DUEL=loop tunes it again. The steady regime is forced (a CPU problem is never there) and the one Triton tile
KERNELS_ONLY leaves is made the challenger."""
import functools

import pytest
import torch

import kernels
from backends import get_backend
from kernels.core.problem import GemmProblem
from kernels.dispatch import selected
from kernels.dispatch.call_duel import CallDuel
from kernels.tune import autotune
from kernels.tune import final_round as fr


def _flat(fns):
    """A WindowClock reading 1 ms for every window (the loop's duel then keeps aten)."""
    return lambda name, untimed, timed: (lambda: 1.0)


@pytest.fixture
def steady(monkeypatch):
    """fp32 16x16x16 on CPU, tuned in the steady regime with one Triton tile as the challenger."""
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    p = GemmProblem.from_tensors("mm", a, b)
    tile = next(c.name for c in get_backend("triton").choices(p, "default")[0] if c.template == "triton_mm")
    kernels.config.only = f"^{tile}$"
    monkeypatch.setattr(autotune, "select", functools.partial(fr.select, windows=_flat))
    monkeypatch.setattr(fr, "CHALLENGER_WITHIN", 1e9)
    kernels.config.backends = "aten,triton"
    return a, b, p, tile


def _until_decided(a, b, p, limit=200):
    for i in range(limit):
        assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-4)
        if selected.selection(p).duel is None:
            return i + 1
    raise AssertionError("no verdict")


def test_the_tune_defers_its_duel_to_the_calls_which_decide_and_store_it(steady):
    a, b, p, tile = steady
    before = kernels.stats()
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert (sel.winner, sel.duel, sel.regime) == ("aten_mm", tile, "steady")
    assert isinstance(selected.resolved(p), CallDuel)
    assert kernels.stats()["call_duels"] == before["call_duels"]
    calls = _until_decided(a, b, p)
    assert calls >= 16           # two windows of MIN_TIMED calls at least (the interpreted tile is far behind)
    decided = selected.selection(p)
    assert decided.winner == "aten_mm" and decided.duel is None
    assert "on the caller's calls" in decided.notes[-1] and "closing window not run" in decided.notes[-1]
    assert decided.details[tile]["first_window_stop"] and "first_pass_ms" in decided.details[tile]
    assert kernels.stats()["call_duels"] == before["call_duels"] + 1
    kernels.clear_memory_cache()             # a fresh lookup reads the verdict: no tune, no duel
    tunes = kernels.stats()["tunes"]
    kernels.mm(a, b)
    again = selected.selection(p)
    assert (again.source, again.duel, again.winner) == ("disk", None, "aten_mm")
    assert kernels.stats()["tunes"] == tunes and not isinstance(selected.resolved(p), CallDuel)


def test_a_stored_pending_duel_is_resumed_by_the_next_process_not_tuned_again(steady):
    a, b, p, tile = steady
    kernels.mm(a, b)
    kernels.clear_memory_cache()             # the process ended before the duel did
    tunes = kernels.stats()["tunes"]
    kernels.mm(a, b)
    sel = selected.selection(p)
    assert (sel.source, sel.duel) == ("disk", tile)
    assert isinstance(selected.resolved(p), CallDuel) and kernels.stats()["tunes"] == tunes
    _until_decided(a, b, p)
    assert kernels.stats()["tunes"] == tunes


def test_loop_mode_tunes_a_pending_duel_again_and_runs_it_in_the_tune(steady):
    a, b, p, tile = steady
    kernels.mm(a, b)
    kernels.clear_memory_cache()
    kernels.config.duel = "loop"
    tunes = kernels.stats()["tunes"]
    with pytest.warns(UserWarning, match="its final round was left to calls"):
        kernels.mm(a, b)
    sel = selected.selection(p)
    assert kernels.stats()["tunes"] == tunes + 1
    assert sel.duel is None and sel.winner == "aten_mm" and sel.details[tile]["final_ms"] == 1.0
    assert not isinstance(selected.resolved(p), CallDuel)


def test_grad_calls_reach_the_duels_and_take_torchs_autograd_once_aten_wins_them(steady):
    """A layer trained with kernels: while its products' duels run, kernels' autograd serves the grad calls (torch's
    would take them from aten's provisional wins, and the duels would never end); once aten has won them all, the
    layer's route is torch's autograd, kept."""
    a, _, _, tile = steady
    w = torch.randn(16, 16, requires_grad=True)
    x = a.clone().requires_grad_(True)
    routed = kernels.stats()["torch_autograd"]
    for step in range(400):
        x.grad = w.grad = None
        kernels.linear(x, w).square().sum().backward()
        if step == 0:
            assert kernels.stats()["duels_pending"] >= 1
            assert kernels.stats()["torch_autograd"] == routed        # kernels' autograd, not kept
        if not kernels.stats()["duels_pending"]:
            break
    assert not kernels.stats()["duels_pending"]
    x.grad = w.grad = None
    kernels.linear(x, w).square().sum().backward()
    ref_x, ref_w = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(ref_x, ref_w).square().sum().backward()
    assert torch.allclose(x.grad, ref_x.grad, atol=1e-3) and torch.allclose(w.grad, ref_w.grad, atol=1e-3)
    assert kernels.stats()["torch_autograd"] == routed + 1             # decided with the verdicts in, and kept


def test_after_the_verdict_the_warm_table_holds_the_winners_own_call(steady):
    """The verdict drops the warm tables (they held the CallDuel): the next call registers aten's torch.mm itself."""
    from kernels.dispatch import api

    a, b, p, tile = steady
    _until_decided(a, b, p)
    kernels.mm(a, b)
    entries = list(api._dispatch.values())
    assert entries and all(not isinstance(getattr(e[1], "__self__", e[1]), CallDuel) for e in entries)
    assert any(e[0] is torch.mm for e in entries)


def test_a_forward_with_grad_and_no_backward_keeps_its_route(steady):
    """Inference that leaves grad on: the backward products' duels never get calls, so the route is kernels'
    autograd, kept (not worked out again on every call: 64 us a call against 7.5 us)."""
    from kernels.dispatch import api

    a, _, _, _ = steady
    w = torch.randn(16, 16, requires_grad=True)
    worked_out = []
    real = api._torchs_autograd_serves
    api_serves = lambda like, problems: worked_out.append(1) or real(like, problems)      # noqa: E731
    try:
        api._torchs_autograd_serves = api_serves
        for _ in range(60):
            out = kernels.linear(a, w)
    finally:
        api._torchs_autograd_serves = real
    assert torch.allclose(out, a @ w.t(), atol=1e-4)
    assert kernels.stats()["duels_pending"] >= 1      # the backward products'
    assert len(worked_out) <= 4                      # once, and again after each verdict (the forward's)


def test_a_stored_challenger_that_cannot_be_loaded_leaves_the_winner_serving(steady, monkeypatch):
    a, b, p, tile = steady
    kernels.mm(a, b)
    kernels.clear_memory_cache()
    real = selected._loaded
    monkeypatch.setattr(selected, "_loaded", lambda sel, name, role, problem, build_missing:
                        None if role == "challenger" else real(sel, name, role, problem, build_missing))
    tunes = kernels.stats()["tunes"]
    assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-4)
    sel = selected.selection(p)
    assert (sel.winner, sel.duel, kernels.stats()["tunes"]) == ("aten_mm", None, tunes)
    assert "was not run here" in sel.notes[-1] and not isinstance(selected.resolved(p), CallDuel)
    monkeypatch.setattr(selected, "_loaded", real)
    kernels.clear_memory_cache()            # kept so: the next process does not load (and run) that challenger again
    kernels.mm(a, b)
    again = selected.selection(p)
    assert (again.source, again.duel, kernels.stats()["tunes"]) == ("disk", None, tunes)


def test_a_duel_under_way_outlives_the_warm_tables_trim(steady):
    """KERNELS_MAX_PROBLEMS=1 with two problems in turn: each return of the dueling problem found a fresh CallDuel
    (reloaded from disk), and the duel never ended."""
    a, b, p, tile = steady
    kernels.config.max_problems = 1
    c, d = torch.randn(8, 8), torch.randn(8, 8)
    for _ in range(100):
        kernels.mm(a, b)
        kernels.mm(c, d)
        if selected.selection(p) is not None and selected.selection(p).duel is None:
            break
    assert selected.selection(p).duel is None and kernels.stats()["call_duels"] >= 1
