"""Dynamic shapes end to end through the Triton interpreter on CPU: hint winners, benchmark and similarity dispatch,
warm dispatch of the exact shape, persistence of bucket decisions across processes, and no new binary for a new M."""
import json
import textwrap

import pytest
import torch

import kernels
from backends.triton_templates import family
from kernels.core import counters
from kernels.core.config import interpret_mode
from kernels.core.errors import InputTypeError, InputValueError
from kernels.core.problem import GemmProblem
from kernels.dispatch import dynamic as dyn_mod
from kernels.dispatch import selected
from kernels.dispatch.dynamic import Dynamic
from kernels.space.dynamic_rules import nearest
from kernels.store.buckets import BucketStore
from tests.helpers import run_python

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

K, N = 32, 24
HINTS = (16, 64)


def weights():
    torch.manual_seed(0)
    return torch.randn(K, N).half()


def rel_err(c, a, b):
    ref = a.double() @ b.double()
    return float((c.double() - ref).norm() / ref.norm())


@pytest.fixture(autouse=True)
def fresh_counters():
    counters.reset()          # kernels.stats() counts per process; each test reads its own


@pytest.fixture
def triton_only():
    # on CPU, aten beats the interpreter at every hint; without it the two hints get different winners
    # (hint 16 clamps every block_m to 16, hint 64 to 32 or 64), so runtime dispatch has something to choose
    kernels.config.backends = ("triton",)


def spec_for(problem, choice):
    return family(choice.template).specs(problem, choice)


def test_benchmark_mode_tunes_hints_once_and_benchmarks_each_bucket_once(triton_only):
    b = weights()
    dyn = Dynamic("m", hints=HINTS, mode="benchmark")
    decisions = {}
    for m in (16, 40, 64, 5, 7, 100):
        a = torch.randn(m, K).half()
        assert rel_err(kernels.mm(a, b, dynamic=dyn), a, b) < 1e-2
        sel = kernels.explain(a, b, dynamic=dyn)
        decisions[m] = sel.decision
        assert sel.source == "dynamic-benchmark" and sel.notes[0] == sel.decision.why()
        assert sel.winner == sel.decision.winner
    winners = decisions[16].hint_winners
    assert set(winners) == {"m=16", "m=64"} and len(set(winners.values())) == 2, winners
    s = kernels.stats()
    assert s["tunes"] == 2                                         # the hints, not the six runtime shapes
    assert s["bucket_benchmarks"] == 4                              # (8,16], (32,64], (4,8], (64,128]
    assert [decisions[m].source for m in (16, 40, 64, 5, 7, 100)] == \
        ["benchmarked", "benchmarked", "memory", "benchmarked", "memory", "benchmarked"]
    assert decisions[64].bucket == "m∈(32,64]" and decisions[64].measured_at == (40, N, K)
    fam = next(iter(dyn_mod._families.values()))
    pool = fam.pool_names(dyn_mod.DYNAMIC_POOL)
    assert set(winners.values()) < set(pool) and len(pool) <= 2 * dyn_mod.DYNAMIC_POOL
    tie_tolerance = kernels.config.tie_tolerance
    for d in decisions.values():
        timed = {n: t for n, t in d.timings.items() if isinstance(t, float)}
        # each hint's winner and runners-up is measured; only the final round's times are floats
        assert set(winners.values()) <= set(d.timings) and d.winner in timed and set(timed) <= set(pool)
        if d.source == "benchmarked" and d.measured_at[0] != 2 ** (d.measured_at[0] - 1).bit_length():
            assert d.also_measured          # the bucket's last size too, unless the runtime size is that edge
        # the bucket goes to a choice tied with the best over its timed sizes (which of the tied ones wins:
        # tests/unit/test_dynamic_rules.py)
        scores = d.worst_ratio or timed
        assert scores[d.winner] <= min(scores.values()) * (1 + max(dyn_mod.BUCKET_TIE_TOLERANCE, tie_tolerance))
        assert f"bucket {d.bucket}" in d.why()


def test_similarity_mode_never_benchmarks_and_picks_the_nearest_hint(triton_only):
    b = weights()
    dyn = Dynamic("m", hints=HINTS, mode="similarity")
    kernels.mm(torch.randn(16, K).half(), b, dynamic=dyn)
    after_tune = kernels.stats()["benchmarks"]
    for m in (1, 5, 16, 31, 32, 33, 64, 200):
        a = torch.randn(m, K).half()
        assert rel_err(kernels.mm(a, b, dynamic=dyn), a, b) < 1e-2
        d = kernels.explain(a, b, dynamic=dyn).decision
        best, dists = nearest((m, N, K), [(h, N, K) for h in HINTS])
        # (grids this small never take a second round over 132 SMs: the tile-step guard does not apply)
        assert d.source == "similarity" and d.hint == f"m={HINTS[best]}"
        assert d.winner == d.hint_winners[d.hint]
        assert d.distances == {f"m={h}": pytest.approx(x) for h, x in zip(HINTS, dists)}
    assert d.hint == "m=64" and "log2 L1 distance" in d.why()
    s = kernels.stats()
    assert s["benchmarks"] == after_tune and s["bucket_benchmarks"] == 0 and s["tunes"] == 2


def test_mode_switching_reuses_the_hint_winners(triton_only):
    b = weights()
    a = torch.randn(40, K).half()
    bench = Dynamic("m", hints=HINTS, mode="benchmark")
    sim = Dynamic("m", hints=HINTS, mode="similarity")
    kernels.mm(a, b, dynamic=bench)
    kernels.mm(a, b, dynamic=sim)
    assert kernels.explain(a, b, dynamic=bench).source == "dynamic-benchmark"
    assert kernels.explain(a, b, dynamic=sim).source == "dynamic-similarity"
    assert kernels.stats()["tunes"] == 2 and kernels.stats()["bucket_benchmarks"] == 1
    # the global declaration: mm without `dynamic=` follows KERNELS_DYNAMIC (read when a shape is first seen): dims
    # and their hints, in the default mode
    kernels.config.dynamic = "m=" + ",".join(map(str, HINTS))
    a2 = torch.randn(48, K).half()
    kernels.mm(a2, b)
    assert kernels.explain(a2, b).source == "dynamic-benchmark"
    assert kernels.stats()["tunes"] == 2                                          # the same hint winners
    assert kernels.explain(a2, b, dynamic=False).source in ("tuned", "memory")    # explicit static
    kernels.config.dynamic = ""
    assert kernels.explain(a2, b).problem.dynamic == ()


def test_exact_shape_goes_to_the_warm_dispatch_table(triton_only, monkeypatch):
    b = weights()
    a = torch.randn(40, K).half()
    dyn = Dynamic("m", hints=HINTS, mode="similarity")
    first = kernels.mm(a, b, dynamic=dyn)
    hits = kernels.stats()["memory_hits"]

    def boom(*args, **kwargs):
        raise AssertionError("the warm path must not reach the dynamic dispatcher")

    monkeypatch.setattr(dyn_mod, "launcher_for", boom)
    again = kernels.mm(a, b, dynamic=dyn)
    assert torch.equal(first, again) and kernels.stats()["memory_hits"] == hits + 1
    # the static call of the same shape has its own entry: it is not served by the dynamic one
    monkeypatch.setattr(selected, "launcher_for", boom)
    with pytest.raises(AssertionError, match="warm path"):
        kernels.mm(a, b)


def test_a_new_m_needs_no_new_binary(triton_only, isolated_cache):
    """Same kernel spec (hence same artifact key: nothing to compile on a GPU) and no new rendered module."""
    b = weights()
    dyn = Dynamic("m", hints=HINTS, mode="similarity")
    kernels.mm(torch.randn(16, K).half(), b, dynamic=dyn)
    src = isolated_cache / "triton" / "src"
    modules = sorted(p.name for p in src.iterdir())
    fam = next(iter(dyn_mod._families.values()))
    for m in (1, 5, 17, 33, 100, 333):
        a = torch.randn(m, K).half()
        kernels.mm(a, b, dynamic=dyn)
        runtime = GemmProblem.from_tensors("mm", a, b)
        for hw in fam.winners:
            dyn_runtime = dyn_mod.substitute(runtime, {}, ("m",))
            assert spec_for(dyn_runtime, hw.choice) == spec_for(hw.problem, hw.choice)
    assert sorted(p.name for p in src.iterdir()) == modules
    assert kernels.stats()["compiles"] == 0
    # without the declaration, M=16 and M=17 specialise differently: the check above is not vacuous
    static16 = GemmProblem.from_tensors("mm", torch.randn(16, K).half(), b)
    static17 = GemmProblem.from_tensors("mm", torch.randn(17, K).half(), b)
    choice = fam.winners[0].choice
    assert spec_for(static16, choice) != spec_for(static17, choice)


def test_dynamic_k_and_only_candidate():
    # default backends: on CPU aten wins both hints; with a pool of one per hint there is nothing to benchmark
    b16 = torch.randn(200, N).half()
    dyn = Dynamic("k", hints=(32, 128), pool=1)
    for k in (48, 200):
        a, b = torch.randn(20, k).half(), b16[:k]
        assert rel_err(kernels.mm(a, b, dynamic=dyn), a, b) < 1e-2
        d = kernels.explain(a, b, dynamic=dyn).decision
        assert d.hint_winners == {"k=32": "aten_mm", "k=128": "aten_mm"}    # the interpreter is ~1000x slower
        assert d.source == "only-candidate" and "nothing to benchmark" in d.why() and d.bucket
    assert kernels.stats()["tunes"] == 2


def test_int_mm_dynamic():
    a, b = torch.randint(-128, 128, (20, 64), dtype=torch.int8), torch.randint(-128, 128, (64, 32), dtype=torch.int8)
    c = kernels.int_mm(a, b, dynamic=Dynamic("m", hints=(16, 64), mode="similarity"))
    assert c.dtype == torch.int32 and torch.equal(c.long(), a.long() @ b.long())


def test_bad_dynamic_arguments():
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    with pytest.raises(InputTypeError, match="dynamic"):
        kernels.mm(a, b, dynamic=["m"])
    with pytest.raises(InputValueError, match="unknown dynamic"):
        kernels.mm(a, b, dynamic="q")
    # 1 == True, but only True means 'm': refused on a warm call too, after True served the same shape
    kernels.config.backends = ("aten",)
    with pytest.raises(InputTypeError, match="dynamic"):
        kernels.mm(a, b, dynamic=1)
    kernels.mm(a, b, dynamic=True)
    hits = kernels.stats().get("memory_hits", 0)
    kernels.mm(a, b, dynamic=True)
    assert kernels.stats().get("memory_hits", 0) == hits + 1          # True itself is served warm
    with pytest.raises(InputTypeError, match="dynamic"):
        kernels.mm(a, b, dynamic=1)


def test_bucket_store_roundtrip_staleness_and_corruption(tmp_path):
    store = BucketStore(tmp_path)
    entry = {"winner": "w1", "timings": {"w1": 0.1, "w2": 0.2}, "measured_at": [40, 24, 32]}
    with store.lock("fam"):
        store.record("fam", ["w1", "w2"], "m∈(32,64]", entry)
        store.record("fam", ["w1", "w2"], "m∈(4,8]", dict(entry, winner="w2"))
    assert store.load("fam", ["w1", "w2"]) == {"m∈(32,64]": entry, "m∈(4,8]": dict(entry, winner="w2")}
    assert store.load("fam", ["w1", "w3"]) == {}          # the hints were re-tuned: old decisions do not apply
    assert store.load("other", ["w1", "w2"]) == {}
    store.path("fam").write_text("{broken")
    assert store.load("fam", ["w1", "w2"]) == {}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


SERVE = textwrap.dedent("""
    import json, sys, torch, kernels
    kernels.config.backends = ("triton",)
    torch.manual_seed(0)
    b = torch.randn(32, 24).half()
    dyn = kernels.Dynamic("m", hints=(16, 64), mode="benchmark")
    out = {}
    for m in [int(x) for x in sys.argv[1:]]:
        a = torch.randn(m, 32).half()
        c = kernels.mm(a, b, dynamic=dyn)
        ref = a.double() @ b.double()
        d = kernels.explain(a, b, dynamic=dyn).decision
        out[m] = {"winner": d.winner, "source": d.source, "bucket": d.bucket,
                  "ok": float((c.double() - ref).norm() / ref.norm()) < 1e-2}
    print(json.dumps({"decisions": out, "stats": kernels.stats()}))
""")


def _serve(cache, *ms):
    proc = run_python(f"import sys; sys.argv = ['x', {', '.join(map(repr, map(str, ms)))}]\n" + SERVE,
                      {"KERNELS_CACHE_DIR": str(cache), "TRITON_INTERPRET": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_bucket_decisions_persist_across_processes(isolated_cache):
    first = _serve(isolated_cache, 5, 40, 100)
    assert all(d["ok"] for d in first["decisions"].values())
    assert first["stats"]["tunes"] == 2 and first["stats"]["bucket_benchmarks"] == 3
    assert {d["source"] for d in first["decisions"].values()} == {"benchmarked"}
    second = _serve(isolated_cache, 5, 40, 100, 7)     # 7 shares 5's bucket: read from disk, not benchmarked
    s = second["stats"]
    assert s["tunes"] == 0 and s["bucket_benchmarks"] == 0 and s["benchmarks"] == 0 and s["compiles"] == 0
    assert s["disk_hits"] == 2 and s["bucket_disk_hits"] == 3
    for m in ("5", "40", "100"):
        assert second["decisions"][m]["winner"] == first["decisions"][m]["winner"]
        assert second["decisions"][m]["source"] == "stored"
    assert second["decisions"]["7"]["source"] == "memory"
    assert second["decisions"]["7"]["winner"] == first["decisions"]["5"]["winner"]
    stored = list((isolated_cache / "selections" / "dynamic").glob("*.json"))
    assert len(stored) == 1 and set(json.loads(stored[0].read_text())["buckets"]) == \
        {"m∈(4,8]", "m∈(32,64]", "m∈(64,128]"}


def test_aten_limits_make_a_hint_winner_unusable_for_a_shape():
    """torch._int_mm needs M > 16 on CUDA: a hint winner that is aten_int_mm cannot serve M=8 (pure: no GPU used)."""
    from kernels.core.choice import Choice
    from kernels.core.selection import Selection

    base = GemmProblem(op="int_mm", m=64, n=64, k=64, dtype="int8", out_dtype="int32", stride_a=(64, 1),
                       stride_b=(64, 1), align_a=16, align_b=16, device="cuda", arch=90, device_name="gpu")
    fam = dyn_mod.Family(dyn_mod.substitute(base, {}, ("m",)), Dynamic("m", hints=(64,)).resolved())
    choice = Choice("aten", "aten_int_mm", "int8")
    fam.winners = [dyn_mod.HintWinner({"m": 64}, fam.hint_problems[0],
                                      Selection(problem=fam.hint_problems[0], winner=choice.name,
                                                choices={choice.name: choice}, timings={choice.name: 0.1}))]
    entries, notes = fam.pool(dyn_mod.substitute(base, {"m": 8}, ("m",)), 3)
    assert entries == [] and "needs M > 16" in notes[0]
    entries, notes = fam.pool(dyn_mod.substitute(base, {"m": 32}, ("m",)), 3)
    assert [(e.hint, e.rank) for e in entries] == [(fam.winners[0], 1)] and notes == []


def test_no_usable_hint_winner_tunes_the_shape_itself(triton_only, monkeypatch):
    b = weights()
    dyn = Dynamic("m", hints=HINTS, mode="similarity")
    kernels.mm(torch.randn(16, K).half(), b, dynamic=dyn)
    monkeypatch.setattr(dyn_mod.Family, "pool", lambda self, runtime, per_hint:
                        ([], ["every winner: cannot (simulated)"]))
    a = torch.randn(40, K).half()
    assert rel_err(kernels.mm(a, b, dynamic=dyn), a, b) < 1e-2
    sel = kernels.explain(a, b, dynamic=dyn)
    assert sel.decision.source == "own-tune" and "cannot (simulated)" in sel.notes[0]
    assert sel.problem.m == 40 and sel.problem.dynamic == ("m",) and kernels.stats()["tunes"] == 3
