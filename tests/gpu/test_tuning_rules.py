"""GPU: the tuning rules for short problems, end to end on a real GPU -- the GPU-time screen of host-set first passes,
the stages a tune records, and `model relabel`'s GPU times (their CPU tests stand in for the GPU timer)."""
import pytest

import kernels
from kernels.core.selection import NOT_VERIFIED, Selection
from kernels.measure.verify import VERIFIED_TOP

pytestmark = pytest.mark.gpu


def _tuned(op, dtype, m, n, k) -> Selection:
    from experiments.fast_preset import cuda_problem
    from kernels.tune.autotune import tune

    sel, _ = tune(cuda_problem(op, dtype, m, n, k), ("aten", "triton"))
    return sel


def test_host_set_first_pass_is_screened_by_gpu_time(isolated_cache):
    """A problem at the host floor (bf16 24x6144x1536: ~10 us of GPU time, 11-20 us per call on the H100): the first
    pass's calls are GPU-timed, and the GPU-fastest of them is a finalist whatever its first-pass call time."""
    kernels.config.preset = "fast"
    sel = _tuned("mm", "bf16", 24, 6144, 1536)
    screened = {n: d["gpu_ms"] for n, d in sel.details.items() if d.get("gpu_ms") is not None}
    assert len(screened) >= 2, sel.table(rounds=True)
    finalists = {n for n, d in sel.details.items() if "final_ms" in d}
    assert min(screened, key=screened.get) in finalists, sel.table(rounds=True)
    assert sel.winner in finalists
    assert {"candidates", "build", "verify", "first_pass", "final_round", "gpu_time"} <= set(sel.stage_seconds)
    assert sum(sel.stage_seconds.values()) <= sel.tune_seconds


def test_large_problem_takes_no_gpu_time(isolated_cache):
    """Above HOST_BOUND_MAX_MS per call nothing is captured: the final round's call times decide, in the
    power-steady regime (a duel of aten and the first pass's fastest other), aten's spread against itself on record;
    only those two and the first pass's fastest three are verified."""
    kernels.config.preset = "fast"
    sel = _tuned("mm", "bf16", 4096, 4096, 4096)
    assert not any("gpu_ms" in d for d in sel.details.values()), sel.table(rounds=True)
    assert "gpu_time" not in sel.stage_seconds
    assert sel.regime == "steady", sel.table(rounds=True)
    aten = next(n for n in sel.choices if n.startswith("aten"))
    finalists = {n: d for n, d in sel.details.items() if "final_ms" in d}
    assert aten in finalists and any(note.startswith("steady round:") for note in sel.notes)
    if len(finalists) == 2:    # a duel ran: B C B, or B C where the challenger's first window could not win
        stopped = any(d.get("first_window_stop") for d in finalists.values())
        assert ("self_spread" in finalists[aten]) != stopped, sel.table(rounds=True)
        assert len(finalists[aten]["final_windows_ms"]) == (1 if stopped else 2)
        assert all(len(d["final_windows_ms"]) >= 1 for d in finalists.values())
    else:                      # no challenger came within CHALLENGER_WITHIN of aten's first pass
        assert list(finalists) == [aten] and any("none ran" in note for note in sel.notes), sel.notes
    # verified: the first pass's fastest VERIFIED_TOP and the duel's two; every other timed candidate is on record
    # unverified, with its first pass, and slower than those
    verified = {n for n, t in sel.timings.items() if isinstance(t, float)}
    first = sel.first_pass()
    top = sorted(first, key=first.get)[:VERIFIED_TOP]
    assert sel.winner in verified and set(finalists) <= verified <= set(finalists) | set(top), sel.table(rounds=True)
    unverified = sel.unverified()
    assert all(sel.timings[n].startswith(NOT_VERIFIED) and first[n] == sel.details[n]["median_ms"] > 0
               for n in unverified)
    assert all(first[n] >= max(first[t] for t in top) for n in unverified), sel.table(rounds=True)


def test_the_child_verifies_its_fastest_three_where_the_caller_duels(isolated_cache, monkeypatch):
    """A problem the caller will duel (its fastest first pass and every timing in the child STEADY_MIN_MS or more):
    the isolated child times all of its candidates, then verifies them fastest first until VERIFIED_TOP pass; the
    others come back unverified, on record with their first pass, none faster than those three. Triton tiles stand in
    for CUTLASS's here (made isolated), so nvcc builds nothing; the child's code path is the same."""
    from backends.triton import TritonBackend

    monkeypatch.setattr(TritonBackend, "isolated", True)
    kernels.config.preset = "fast"
    kernels.config.benchmark_space = 2 * VERIFIED_TOP + 2      # the model's top 8: slack above the three verified
    sel = _tuned("mm", "bf16", 4096, 4096, 4096)
    in_child = {n for n, d in sel.details.items() if d.get("measured_in") == "child"}
    assert len(in_child) > VERIFIED_TOP, sel.table(rounds=True)
    verified = {n for n in in_child if isinstance(sel.timings[n], float)}
    unverified = in_child - verified
    assert len(verified) == VERIFIED_TOP, sel.table(rounds=True)
    assert all(sel.timings[n].startswith(NOT_VERIFIED) for n in unverified), sel.table(rounds=True)
    first = sel.first_pass()
    assert min(first[n] for n in unverified) >= max(first[n] for n in verified), sel.table(rounds=True)
    assert sel.regime == "steady" and sel.winner not in unverified


def test_relabel_writes_gpu_times_below_the_call_times(tmp_path, isolated_cache):
    from tools.perf_model.data import collect, read_dataset
    from tools.perf_model.relabel import relabel

    data, out = tmp_path / "d.csv", tmp_path / "g.csv"
    assert collect([(64, 64, 256)], ["int8"], data, max_configs=4, bench_ms=5.0, progress=lambda s: None) > 1
    assert relabel([str(data)], str(out), below_ms=1.0, progress=lambda s: None) > 1
    rows, bad = read_dataset([out])
    assert not bad and rows
    for r in rows:
        # a GPU time leaves the host out: never much above the call it was taken from (noise aside)
        assert r.gpu_ms is not None and 0 < r.gpu_ms <= 1.2 * r.ms, (r.choice.name, r.ms, r.gpu_ms)
