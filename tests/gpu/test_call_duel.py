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
