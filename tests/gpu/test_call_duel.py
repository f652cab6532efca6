"""GPU: the duel on calls (KERNELS_DUEL=calls) end to end: a large problem's tune leaves its duel to the calls, CUDA
events time them without a sync, the verdict is stored and served; a call captured in a CUDA graph meanwhile gets
the baseline. A challenger is forced (any Triton tile within reach of aten) so the duel always runs."""
import time

import pytest
import torch

import kernels
from kernels.dispatch import selected
from kernels.dispatch.call_duel import CallDuel
from kernels.tune import final_round as fr

pytestmark = pytest.mark.gpu


def _operands(m, n, k):
    torch.manual_seed(0)
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()      # nn.Linear's weight, column-major
    return a, b


def test_a_large_problems_duel_runs_on_its_calls_and_its_verdict_is_stored(isolated_cache, monkeypatch):
    monkeypatch.setattr(fr, "CHALLENGER_WITHIN", 10.0)
    kernels.config.backends = ("aten", "triton")
    kernels.config.preset = "fast"
    a, b = _operands(4096, 4096, 4096)
    ref = (a.double() @ b.double()).float()
    start = time.perf_counter()
    kernels.mm(a, b)
    first_s = time.perf_counter() - start
    sel = kernels.explain(a, b)
    assert sel.regime == "steady" and sel.duel is not None, sel.table()
    assert kernels.stats()["duels_pending"] == 1
    duel = selected.resolved(sel.problem)
    assert isinstance(duel, CallDuel)
    # a graph captured meanwhile gets the baseline, and the capture does not disturb the duel
    static = torch.empty(4096, 4096, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        static.copy_(kernels.mm(a, b))
    graph.replay()
    worst, calls, t0 = 0.0, 0, time.perf_counter()
    while kernels.stats()["duels_pending"] and time.perf_counter() - t0 < 20:
        for _ in range(20):
            out = kernels.mm(a, b)
        calls += 20
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
    duel_s = time.perf_counter() - t0
    assert not kernels.stats()["duels_pending"], (calls, duel.windows_ms)
    assert worst < 1e-2 and float((static.float() - ref).norm() / ref.norm()) < 1e-2
    decided = kernels.explain(a, b)
    assert decided.duel is None and decided.winner == duel.winner
    assert "on the caller's calls" in decided.notes[-1], decided.notes
    assert len(duel.windows_ms) in (2, 3) and all(w > 0 for w in duel.windows_ms)
    print(f"first call {first_s:.2f} s, duel on {calls} calls {duel_s:.2f} s, windows {duel.windows_ms}, "
          f"winner {decided.winner}: {decided.notes[-1]}")
    kernels.clear_memory_cache()
    tunes = kernels.stats()["tunes"]
    kernels.mm(a, b)
    again = selected.selection(decided.problem)
    assert (again.source, again.duel, again.winner) == ("disk", None, decided.winner)
    assert kernels.stats()["tunes"] == tunes and not isinstance(selected.resolved(decided.problem), CallDuel)


def test_a_first_tune_leaves_the_childs_candidates_to_the_calls_while_the_child_starts(isolated_cache, monkeypatch):
    """The process's first tune with isolated candidates (Triton tiles made isolated stand in for CUTLASS's: nvcc
    builds nothing) and the child held at its start: aten serves, the call after the child is up has the tiles
    measured there, the fastest verified one duels aten on the calls, and the result stays right throughout."""
    from backends import child_handle
    from backends.triton import TritonBackend

    monkeypatch.setattr(fr, "CHALLENGER_WITHIN", 10.0)
    monkeypatch.setattr(TritonBackend, "isolated", True)
    kernels.config.backends = ("aten", "triton")
    kernels.config.preset = "fast"
    child_handle.close()
    held = [True]
    real = child_handle.start_state
    monkeypatch.setattr(child_handle, "start_state", lambda device=None: "starting" if held[0] else real(device))
    a, b = _operands(4096, 4096, 4096)
    ref = (a.double() @ b.double()).float()
    kernels.mm(a, b)
    sel = kernels.explain(a, b)
    assert sel.regime == "steady" and sel.unmeasured and sel.duel is None, sel.table()
    for _ in range(20):
        kernels.mm(a, b)
    held[0] = False
    assert child_handle.warmed() == "done"
    worst, slowest, t0 = 0.0, 0.0, time.perf_counter()
    while kernels.stats()["duels_pending"] and time.perf_counter() - t0 < 30:
        t1 = time.perf_counter()
        out = kernels.mm(a, b)
        slowest = max(slowest, time.perf_counter() - t1)
        worst = max(worst, float((out.float() - ref).norm() / ref.norm()))
    decided = kernels.explain(a, b)
    assert not kernels.stats()["duels_pending"] and not decided.awaiting_calls, decided.table()
    in_child = [n for n, d in decided.details.items() if d.get("measured_in") == "child"]
    assert in_child and worst < 1e-2, decided.table()
    assert any("measured in the isolated child on the caller's calls" in n for n in decided.notes), decided.notes
    print(f"joined {len(in_child)} in the child, slowest call {slowest:.2f} s "
          f"(isolated_on_calls {decided.stage_seconds.get('isolated_on_calls')}), winner {decided.winner}: "
          f"{decided.notes[-1]}")
    child_handle.close()
