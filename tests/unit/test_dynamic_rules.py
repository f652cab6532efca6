"""Dynamic shapes, the pure parts: knob parsing, buckets, the log2 distance, hint substitution, declaration."""
import math

import pytest

import kernels
from kernels.core.dynamic_spec import (
    DEFAULT_HINTS,
    BucketRule,
    hints_for,
    parse_buckets,
    parse_dims,
    parse_hints,
    parse_mode,
)
from kernels.core.errors import InputTypeError, InputValueError
from kernels.core.problem import GemmProblem
from kernels.dispatch.dynamic import DYNAMIC_POOL, Dynamic, resolve, substitute
from kernels.space.dynamic_rules import bucket_id, log2_distance, nearest
from tests.helpers import problem


def prob(m=64, n=48, k=32, sa=None, sb=None, dynamic=()):
    return GemmProblem(op="mm", m=m, n=n, k=k, dtype="fp16", out_dtype="fp16", stride_a=sa or (k, 1),
                       stride_b=sb or (n, 1), align_a=16, align_b=16, device="cpu", arch=0, device_name="cpu",
                       dynamic=dynamic)


@pytest.mark.parametrize("size,bounds", [(1, (0, 1)), (2, (1, 2)), (3, (2, 4)), (4, (2, 4)), (5, (4, 8)),
                                         (4096, (2048, 4096)), (4097, (4096, 8192))])
def test_pow2_buckets(size, bounds):
    assert BucketRule("pow2").bounds(size) == bounds


def test_edge_and_exact_buckets():
    rule = BucketRule(" 16, 64,256 ")
    assert rule.text == "16,64,256"
    assert [rule.bounds(s) for s in (1, 16, 17, 64, 65, 256, 257, 10**6)] == \
        [(0, 16), (0, 16), (16, 64), (16, 64), (64, 256), (64, 256), (256, None), (256, None)]
    assert rule.label("m", 300) == "m∈(256,inf]"
    exact = BucketRule("exact")
    assert exact.bounds(300) == (299, 300) and exact.bounds(301) != exact.bounds(300)
    assert bucket_id(BucketRule("pow2"), {"k": 600, "m": 3}) == "m∈(2,4] k∈(512,1024]"   # m, n, k order


@pytest.mark.parametrize("bad", ["pow3", "64,16", "0,4", "16,16", "", "a,b"])
def test_bad_bucket_rules(bad):
    with pytest.raises(ValueError, match=rf"^bucket (rule|edges) must be .*got {bad!r}$"):
        BucketRule(bad)


def test_bucket_of_nonpositive_size_is_an_error():
    with pytest.raises(ValueError, match=r"bucket of a size < 1 \(0\)"):
        BucketRule("pow2").bounds(0)


def test_log2_distance_counts_each_operand_a_dim_appears_in():
    n, k = 12288, 4096
    assert log2_distance((64, n, k), (64, n, k)) == 0
    assert log2_distance((64, n, k), (256, n, k)) == pytest.approx(4.0)      # M is in A and C: 2 * log2(4)
    assert log2_distance((64, n, k), (64, n, 2 * k)) == pytest.approx(2.0)   # K is in A and B
    assert log2_distance((64, n, k), (64, n // 2, k)) == pytest.approx(2.0)  # N is in B and C
    assert log2_distance((100, n, k), (64, n, k)) == pytest.approx(2 * math.log2(100 / 64))
    assert log2_distance((1, n, k), (4, n, k)) == log2_distance((4, n, k), (1, n, k)) == pytest.approx(4.0)


@pytest.mark.parametrize("m,want", [(1, 64), (64, 64), (100, 64), (128, 256),  # 128, 1024: ties go up
                                    (200, 256), (1000, 256), (1024, 4096),
                                    (2048, 4096), (8192, 4096)])
def test_nearest_hint_for_the_issue_hints(m, want):
    hints = [(h, 12288, 4096) for h in (64, 256, 4096)]
    best, dists = nearest((m, 12288, 4096), hints)
    assert hints[best][0] == want
    assert len(dists) == 3 and dists[best] == min(dists)


def test_nearest_two_dims():
    cands = [(m, 64, k) for m in (16, 256) for k in (64, 1024)]
    best, _ = nearest((200, 64, 900), cands)
    assert cands[best] == (256, 64, 1024)
    best, _ = nearest((20, 64, 70), cands)
    assert cands[best] == (16, 64, 64)


def test_parse_dims_hints_mode():
    assert parse_dims("m") == ("m",) and parse_dims(" K, M ") == ("m", "k") and parse_dims(("k", "n")) == ("n", "k")
    assert parse_dims(True) == ("m",) and parse_dims(False) == () and parse_dims("") == () and parse_dims(None) == ()
    with pytest.raises(ValueError, match="unknown dynamic"):
        parse_dims("m,x")
    assert parse_hints("4096, 64,256,64") == (64, 256, 4096)
    assert parse_hints((16, 32)) == (16, 32)
    assert parse_hints("m=16,64;k=1024") == (("m", (16, 64)), ("k", (1024,)))
    assert parse_hints({"k": [8], "m": (2, 1)}) == (("m", (1, 2)), ("k", (8,)))
    for bad in ("0,64", (-1,), (1.5,), "", "q=4"):
        with pytest.raises(ValueError, match="size hint|unknown dimension"):
            parse_hints(bad)
    assert hints_for((16, 32), ("m", "k")) == {"m": (16, 32), "k": (16, 32)}
    assert hints_for((("k", (8,)),), ("m", "k")) == {"m": DEFAULT_HINTS, "k": (8,)}
    assert parse_mode(" Similarity ") == "similarity"
    with pytest.raises(ValueError, match="dynamic mode must be one of .*got 'guess'"):
        parse_mode("guess")
    assert parse_buckets("pow2") == "pow2"


def test_dynamic_declared_in_the_environment(monkeypatch):
    assert kernels.config.dynamic == () and resolve(None) is None
    monkeypatch.setenv("KERNELS_DYNAMIC", "k, m")
    assert kernels.config.dynamic == (("m", ()), ("k", ()))
    assert resolve(None) == Dynamic(("m", "k"), (("m", DEFAULT_HINTS), ("k", DEFAULT_HINTS)), "benchmark", "pow2",
                                    DYNAMIC_POOL)
    monkeypatch.setenv("KERNELS_DYNAMIC", "m=8,16;k=32")              # dims with their own hints
    assert resolve(None) == Dynamic(("m", "k"), (("m", (8, 16)), ("k", (32,))), "benchmark", "pow2", DYNAMIC_POOL)
    for bad in ("q", "m=0", "m=8;k", ",", "8,16"):
        monkeypatch.setenv("KERNELS_DYNAMIC", bad)
        with pytest.raises(ValueError, match="KERNELS_DYNAMIC"):
            resolve(None)


def test_resolve_declarations():
    assert resolve(None) is None and resolve(False) is None and resolve("") is None and resolve(()) is None
    assert resolve("m") == Dynamic("m", (("m", DEFAULT_HINTS),), "benchmark", "pow2", DYNAMIC_POOL)
    assert resolve(True) == resolve("m") == resolve(("m",))
    with pytest.raises(ValueError, match="holds size hints.*kernels.Dynamic"):     # KERNELS_DYNAMIC's syntax
        resolve("m=8,16")
    with pytest.raises(ValueError, match=r"hints for k, which is not among the dynamic dims \('m',\)"):
        Dynamic("m", hints={"k": (4,)})
    d = Dynamic("m", hints={"m": (32, 16)}, mode="similarity", buckets="exact", pool=1)
    hash(d)                                    # part of the warm dispatch key
    assert resolve(d) == Dynamic("m", (("m", (16, 32)),), "similarity", "exact", 1)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="pool"):
            Dynamic("m", pool=bad)
    with pytest.raises(InputTypeError, match="hashable"):
        resolve(["m"])
    with pytest.raises(InputValueError, match="unknown dynamic"):
        resolve("q")
    with pytest.raises(ValueError, match="Dynamic needs at least one of m, n, k"):
        Dynamic("")


def test_substitute_keeps_layouts_and_padding():
    row = prob(m=40, k=32, sa=(32, 1))
    assert substitute(row, {"m": 256}, ("m",)).stride_a == (32, 1)
    col = prob(m=40, k=32, sa=(1, 40))                       # column-major A: its stride follows M
    got = substitute(col, {"m": 256}, ("m",))
    assert (got.m, got.stride_a, got.layout_a, got.dynamic) == (256, (1, 256), "col", ("m",))
    padded = prob(m=40, k=32, sa=(39, 1))                    # row-major, leading dim padded by 7
    assert substitute(padded, {"k": 100}, ("k",)).stride_a == (107, 1)
    one_row_col = prob(m=1, k=32, sa=(1, 1), sb=(1, 32))      # a column-major (1, K) view and a column-major B
    got = substitute(one_row_col, {"m": 64}, ("m",))
    assert got.stride_a == (1, 64) and got.stride_b == (1, 32)
    strided = prob(m=8, k=32, sa=(64, 2))
    assert substitute(strided, {"m": 16}, ("m",)).stride_a == (64, 2)


def test_outside_hints_is_below_the_smallest_or_above_the_largest():
    from kernels.space.dynamic_rules import outside_hints

    points = [{"m": 64}, {"m": 256}, {"m": 4096}]
    assert outside_hints({"m": 1}, points) and outside_hints({"m": 31}, points) and outside_hints({"m": 8193}, points)
    assert not any(outside_hints({"m": m}, points) for m in (32, 63, 64, 100, 4096, 8192))   # within 2x: not
    assert outside_hints({"m": 63}, points, margin=1.0)
    grid = [{"m": m, "k": k} for m in (16, 64) for k in (1024, 4096)]
    assert outside_hints({"m": 32, "k": 500}, grid) and not outside_hints({"m": 32, "k": 2048}, grid)


def test_similarity_extrapolates_with_the_aten_winner():
    """Below the smallest hint, a hint's fixed Triton tile is extrapolated; the aten winner of another hint is
    not (cuBLAS picks per call), so it serves. Inside the hints, the nearest hint still serves."""
    from kernels.core.choice import Choice
    from kernels.core.selection import Selection
    from kernels.dispatch.dynamic import Dynamic, Family, HintWinner, resolve, substitute
    from kernels.space.heuristics import GemmConfig

    base = problem(m=64, n=4096, k=11008)
    fam = Family(base, resolve(Dynamic("m", hints=(64, 256, 4096), mode="similarity")))
    tile = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 128, 5, 4))
    aten = Choice("aten", "aten_mm", "bf16")
    winners = []
    for m, choice in ((64, tile), (256, tile), (4096, aten)):
        hp = substitute(base, {"m": m}, ("m",))
        winners.append(HintWinner({"m": m}, hp, Selection(hp, choice.name, {choice.name: choice}, {choice.name: 0.1})))
    fam.winners = winners
    def similarity(m):
        runtime = substitute(base, {"m": m}, ("m",))
        return fam.similarity(runtime, fam.pool(runtime, 1)[0])[0]

    below = similarity(4)
    assert below.winner == "aten_mm" and below.hint == "m=4096" and "outside the hints" in below.notes[0]
    inside = similarity(200)
    assert inside.winner == tile.name and inside.hint == "m=256" and not inside.notes


def test_waves_count_rounds_of_programs_over_the_sms():
    from kernels.space.dynamic_rules import waves

    assert waves(64, 4096, 64, 32, 1, 132) == 1 and waves(74, 4096, 64, 32, 1, 132) == 2     # 128 -> 256 programs
    assert waves(64, 4096, 64, 64, 1, 132) == waves(128, 4096, 64, 64, 1, 132) == 1         # 64 -> 128 programs
    assert waves(129, 4096, 64, 64, 1, 132) == 2 and waves(32, 32, 32, 32, 64, 132) == 1
    assert waves(16, 4096, 16, 64, 4, 132) == 2                                              # 64 tiles x 4 splits


def _family(winners_by_m, runners_up=()):
    """A similarity/benchmark Family over K=11008, N=4096 with the given hint winners (no tuning, no GPU)."""
    from kernels.core.selection import Selection
    from kernels.dispatch.dynamic import Dynamic, Family, HintWinner, resolve, substitute

    base = problem(m=64, n=4096, k=11008)
    fam = Family(base, resolve(Dynamic("m", hints=tuple(winners_by_m), mode="similarity")))
    winners = []
    for m, choice in winners_by_m.items():
        hp = substitute(base, {"m": m}, ("m",))
        others = [c for hm, c in runners_up if hm == m]
        everyone = [choice, *others]
        timings = {c.name: 0.1 + 0.01 * i for i, c in enumerate(everyone)}
        winners.append(HintWinner({"m": m}, hp, Selection(hp, choice.name, {c.name: c for c in everyone}, timings)))
    fam.winners = winners
    return fam, base


def test_similarity_does_not_stretch_a_tile_past_its_step():
    """The nearest hint below whose tile's grid would take another round over the SMs here gives way to the
    nearest hint above; a tile whose grid still fits one round keeps serving (the two H100 sweeps at K=11008,
    N=4096: a 64x32 tile from M=74 on, a 64x64 tile only from M=129 on)."""
    from kernels.core.choice import Choice
    from kernels.dispatch.dynamic import substitute
    from kernels.space.heuristics import GemmConfig

    aten = Choice("aten", "aten_mm", "bf16")
    for tile, cases in ((GemmConfig(64, 32, 128, 5, 4), ((64, "m=64"), (50, "m=64"), (74, "m=256"), (110, "m=256"),
                                                          (300, "m=256"), (20, "m=256"))),
                        (GemmConfig(64, 64, 128, 5, 4), ((74, "m=64"), (112, "m=64"), (120, "m=64"), (129, "m=256")))):
        fam, base = _family({64: Choice("triton", "triton_mm", "bf16", tile), 256: aten, 4096: aten})
        for m, hint in cases:
            runtime = substitute(base, {"m": m}, ("m",))
            dec, ranking = fam.similarity(runtime, fam.pool(runtime, 1)[0])
            assert dec.hint == hint, (tile, m, dec)
            assert ranking[0] == dec.winner
            if (tile.block_n, m) == (32, 74):
                assert "more rounds of programs" in dec.notes[0] and dec.winner == "aten_mm"


def test_benchmark_pool_holds_each_hints_runners_up(monkeypatch, tmp_path):
    """Benchmark mode times each hint's winner and runners-up: a runner-up of hint 256 may serve M=357."""
    from kernels.core.choice import Choice
    from kernels.dispatch import dynamic as dyn_mod
    from kernels.dispatch.dynamic import substitute
    from kernels.space.heuristics import GemmConfig
    from kernels.store.buckets import BucketStore

    aten = Choice("aten", "aten_mm", "bf16")
    t64 = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 32, 128, 5, 4))
    t128 = Choice("triton", "triton_mm", "bf16", GemmConfig(128, 128, 64, 5, 8))
    t256 = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 128, 128, 4, 4))
    fam, base = _family({64: t64, 256: aten}, runners_up=[(256, t128), (256, t256), (64, aten)])
    fam.store = BucketStore(tmp_path)
    one = {"per_hint": 2, "probes": "one"}          # the bucket's edges: test_bucket_edges_are_benchmarked_too
    assert fam.pool_names(2) == [t64.name, aten.name, t128.name]
    runtime = substitute(base, {"m": 357}, ("m",))
    entries, _ = fam.pool(runtime, 2)
    assert [e.label for e in entries] == ["m=64", "m=64 #2", "m=256", "m=256 #2"]
    timed = []
    monkeypatch.setattr(dyn_mod, "benchmark_choices", lambda p, cs: timed.append([c.name for c in cs]) or
                        {t64.name: 0.2, aten.name: 0.08, t128.name: 0.064})
    dec, ranking = fam.benchmark(runtime, entries, **one)
    assert timed == [[t64.name, aten.name, t128.name]]
    assert dec.winner == t128.name and dec.hint == "m=256 #2" and ranking == [t128.name, aten.name, t64.name]
    assert "(hint m=256 #2)" in dec.why()
    again, _ = fam.benchmark(substitute(base, {"m": 400}, ("m",)), entries, **one)   # same bucket (256, 512]
    assert again.source == "memory" and again.winner == t128.name and len(timed) == 1
    fam.buckets.clear()                                         # a bigger pool: the stored decision is stale
    fam.benchmark(runtime, fam.pool(runtime, 3)[0], per_hint=3, probes="one")
    assert len(timed) == 2


def test_compute_bound_bucket_ties_go_to_the_simpler_choice_then_a_hints_winner(monkeypatch, tmp_path):
    """In a compute-bound bucket (M=357 here), within 5% of the fastest the simpler choice wins it (aten, a runner-up,
    over M=256's own tile 3% faster), then a hint's own winner over another choice (M=64's tile over its runner-up
    3% faster); beyond 5% the fastest wins."""
    from kernels.core.choice import Choice
    from kernels.dispatch import dynamic as dyn_mod
    from kernels.dispatch.dynamic import substitute
    from kernels.space.heuristics import GemmConfig
    from kernels.store.buckets import BucketStore

    aten = Choice("aten", "aten_mm", "bf16")
    t64 = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 32, 128, 5, 4))
    t128 = Choice("triton", "triton_mm", "bf16", GemmConfig(128, 128, 64, 5, 8))
    t256 = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 128, 128, 4, 4))
    fam, base = _family({64: t64, 256: t128}, runners_up=[(64, t256), (256, aten)])
    runtime = substitute(base, {"m": 357}, ("m",))

    def bucket_winner(ms, store):
        monkeypatch.setattr(dyn_mod, "benchmark_choices", lambda p, cs: {c.name: ms[c.name] for c in cs})
        fam.buckets.clear()
        fam.store = BucketStore(tmp_path / store)
        return fam.benchmark(runtime, fam.pool(runtime, 2)[0], per_hint=2, probes="one")[0].winner

    slow = {t64.name: 0.2, t128.name: 0.2, t256.name: 0.2, aten.name: 0.2}
    assert bucket_winner(dict(slow, **{t128.name: 0.064, aten.name: 0.066}), "a") == aten.name
    assert bucket_winner(dict(slow, **{t256.name: 0.064, t64.name: 0.066}), "b") == t64.name
    assert bucket_winner(dict(slow, **{t128.name: 0.064, aten.name: 0.080}), "c") == t128.name     # 25%: no tie


def test_probe_sizes_are_the_runtime_size_and_the_bucket_edges():
    from kernels.core.dynamic_spec import BucketRule
    from kernels.space.dynamic_rules import probe_sizes

    pow2 = BucketRule("pow2")
    assert probe_sizes(pow2, {"m": 3}) == [{"m": 3}, {"m": 4}]                  # (2, 4]: 3 is the first size
    assert probe_sizes(pow2, {"m": 357}) == [{"m": 357}, {"m": 257}, {"m": 512}]
    assert probe_sizes(pow2, {"m": 1}) == [{"m": 1}]
    assert probe_sizes(BucketRule("exact"), {"m": 77}) == [{"m": 77}]
    assert probe_sizes(BucketRule("16,64"), {"m": 100}) == [{"m": 100}, {"m": 65}]   # unbounded: no last size
    assert probe_sizes(pow2, {"m": 100, "k": 3000}) == [{"m": 100, "k": 3000}, {"m": 65, "k": 2049},
                                                        {"m": 128, "k": 4096}]


def test_worst_ratio_over_probes():
    from kernels.space.dynamic_rules import worst_ratio

    at_3 = {"aten": 0.036, "split": 0.035, "tile": "crashed"}
    at_4 = {"aten": 0.045, "split": 0.036}
    scores = worst_ratio([at_3, at_4])
    assert set(scores) == {"aten", "split"}
    assert scores["split"] == 1.0 and abs(scores["aten"] - 0.045 / 0.036) < 1e-12
    assert worst_ratio([{"a": 0.1, "b": 0.2}, {"a": "failed", "b": 0.2}]) == {"b": 1.0}


def _split_k_vs_aten_bucket(monkeypatch, tmp_path, per_m, m=3):
    """The bucket of M=`m` ((2, 4] by default) at K=11008, N=4096 with two hint winners, split-K (M=64) and aten
    (M=256), one candidate each, benchmark_choices faked from `per_m` (M -> name -> ms, keyed 'aten' / 'split').
    Returns (aten, split, fam, the M=`m` runtime problem, the M values benchmarked so far). Benchmark with
    per_hint=1."""
    from kernels.core.choice import Choice
    from kernels.dispatch import dynamic as dyn_mod
    from kernels.dispatch.dynamic import substitute
    from kernels.space.heuristics import GemmConfig
    from kernels.store.buckets import BucketStore

    aten = Choice("aten", "aten_mm", "bf16")
    split = Choice("triton", "split_k", "bf16", GemmConfig(16, 64, 64, 4, 4), (("split", 4),))
    fam, base = _family({64: split, 256: aten})
    fam.store = BucketStore(tmp_path)
    names = {aten.name: "aten", split.name: "split"}
    seen = []

    def fake(problem, choices):
        seen.append(problem.m)
        return {c.name: per_m[problem.m][names[c.name]] for c in choices}

    monkeypatch.setattr(dyn_mod, "benchmark_choices", fake)
    return aten, split, fam, substitute(base, {"m": m}, ("m",)), seen


def test_bucket_edges_are_benchmarked_too(monkeypatch, tmp_path):
    """cuBLAS's kernel changes inside a bucket (H100, K=11008, N=4096: aten 36 us at M=3, 45 us at M=4): timed at
    M=3 alone, aten wins the (2, 4] bucket on the simpler-choice tie (within the tuning tolerance: the bucket is
    memory-bound) and serves M=4 at 1.23x. With the edge timed too, the choice that holds up over the whole bucket
    wins."""
    from kernels.store.buckets import BucketStore

    per_m = {3: {"aten": 0.0356, "split": 0.0354}, 4: {"aten": 0.0455, "split": 0.0369}}
    aten, split, fam, runtime, seen = _split_k_vs_aten_bucket(monkeypatch, tmp_path, per_m)
    entries, _ = fam.pool(runtime, 1)
    dec, _ = fam.benchmark(runtime, entries, per_hint=1)
    assert seen == [3, 4] and dec.winner == split.name
    assert dec.also_measured == ["4x4096x11008"] and "and 4x4096x11008" in dec.why()
    fam.buckets.clear()
    fam.store = BucketStore(tmp_path / "other")
    dec, _ = fam.benchmark(runtime, entries, per_hint=1, probes="one")
    assert seen == [3, 4, 3] and dec.winner == aten.name


def test_round_inflation_predicts_a_part_empty_last_round():
    from kernels.space.dynamic_rules import round_inflation

    tile = (128, 256, 1, 132)
    assert round_inflation((4096, 4096), (4096, 4096), *tile) == 1.0
    assert abs(round_inflation((1106, 4096), (4096, 4096), *tile) - 2 / 4 * 4096 / 1106) < 1e-12   # 144 programs
    assert round_inflation((1960, 4096), (4096, 4096), *tile) < 1.05                                  # 256: 2 full


def test_similarity_leaves_a_tile_whose_last_round_runs_part_empty():
    """The M=4096 hint's 128x256 tile at M=1106 (2 rounds, the second nearly empty) gives way to the M=256 hint's
    aten winner; at M=1960 (2 full rounds) it keeps serving; a memory-bound hint's tile is never judged by rounds."""
    from kernels.core.choice import Choice
    from kernels.dispatch.dynamic import substitute
    from kernels.space.heuristics import GemmConfig

    aten = Choice("aten", "aten_mm", "bf16")
    tma = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))
    small = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 128, 5, 4))
    fam, base = _family({64: small, 256: aten, 4096: tma})
    for m, hint in ((1106, "m=256"), (2261, "m=256"), (1960, "m=4096"), (4096, "m=4096"), (36, "m=64")):
        runtime = substitute(base, {"m": m}, ("m",))
        dec, ranking = fam.similarity(runtime, fam.pool(runtime, 1)[0])
        assert dec.hint == hint, (m, dec)
        if m == 1106:
            assert "part-empty" in dec.notes[0] and ranking[0] == aten.name


def test_benchmark_mode_leaves_a_bucket_winner_whose_rounds_step_up_between_timed_sizes():
    """H100, K=4096, N=12288: the 128x256 TMA tile won the (512, 1024] bucket timed at M=513 and 1024 (2 and 3
    rounds over 132 SMs), then ran M=720 (3 rounds for 70% of M=1024's work) at 1.34x a per-M tune. From the
    bucket's own timings the guard predicts that and serves aten there; at M=1000 (3 rounds, nearly full) and at
    the timed sizes the tile keeps serving; a memory-bound bucket is never judged by rounds."""
    from kernels.core.choice import Choice
    from kernels.dispatch.dynamic import inflation_guard, substitute
    from kernels.space.heuristics import GemmConfig

    aten = Choice("aten", "aten_mm", "bf16")
    tma = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))
    choices = {aten.name: aten, tma.name: tma}
    base = problem(m=1024, n=12288, k=4096)
    probes = [(substitute(base, {"m": 1024}, ("m",)), {aten.name: 0.1460, tma.name: 0.1410}),
              (substitute(base, {"m": 513}, ("m",)), {aten.name: 0.0800, tma.name: 0.0790})]
    for m, served in ((720, aten.name), (831, aten.name), (1000, tma.name), (1024, tma.name), (513, tma.name)):
        runtime = substitute(base, {"m": m}, ("m",))
        winner, note = inflation_guard(tma.name, runtime, probes, choices, frozenset({aten.name}))
        assert winner == served, (m, note)
        assert ("part-empty" in note) == (served == aten.name)
    skinny = problem(m=64, n=12288, k=4096)                       # memory-bound: rounds do not set its time
    small = [(substitute(skinny, {"m": m}, ("m",)), {aten.name: 0.040, tma.name: 0.039}) for m in (33, 64)]
    assert inflation_guard(tma.name, substitute(skinny, {"m": 40}, ("m",)), small, choices, frozenset())[0] == tma.name


def test_memory_bound_buckets_do_not_hand_ties_to_aten(monkeypatch, tmp_path):
    """H100, K=11008, N=4096, bucket (2, 4]: split-K's worst ratio over M=3, 4 was 1.0, aten's 1.041; under the 5%
    simpler-choice rule aten won and ran M=4 at 1.15x a per-M tune. A memory-bound bucket takes the tuning tie
    tolerance only; a compute-bound one keeps the 5% rule: the same ratios in the (256, 512] bucket go to aten."""
    per_m = {3: {"aten": 0.03587, "split": 0.03454}, 4: {"aten": 0.0360, "split": 0.0350}}
    aten, split, fam, runtime, _ = _split_k_vs_aten_bucket(monkeypatch, tmp_path, per_m)
    dec, _ = fam.benchmark(runtime, fam.pool(runtime, 1)[0], per_hint=1)
    assert dec.winner == split.name
    per_m = {m: {"aten": 100 * m * 0.03587, "split": 100 * m * 0.03454} for m in (357, 257, 512)}
    aten, split, fam, runtime, seen = _split_k_vs_aten_bucket(monkeypatch, tmp_path / "compute", per_m, m=357)
    dec, _ = fam.benchmark(runtime, fam.pool(runtime, 1)[0], per_hint=1)
    assert seen == [357, 257, 512] and dec.winner == aten.name


def test_similarity_serves_an_aten_winners_tied_tile_away_from_its_hint():
    """cuBLAS picks its kernel per shape: aten won the M=256 hint, then ran M=229 at 1.21x a per-M tune where the
    hint's runner-up 64x128 tile ran 1.00x (H100, K=11008, N=4096). Away from its hint, inside the hints, on a
    memory-bound shape, an aten winner gives way to its hint's runner-up tile when that tied it at the hint and takes
    no more rounds here; at the hint itself, past the tile's step, with a tile that lost by more than the tolerance,
    and outside the hints, aten keeps serving. (The test GPU's ridge puts M <= 229 at this K, N memory-bound.)"""
    from kernels.core.choice import Choice
    from kernels.dispatch.dynamic import substitute
    from kernels.space.heuristics import GemmConfig

    aten = Choice("aten", "aten_mm", "bf16")
    small = Choice("triton", "triton_mm", "bf16", GemmConfig(16, 64, 128, 5, 4))
    tile = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 128, 4, 4))
    fam, base = _family({16: small, 64: small, 128: aten}, runners_up=[(128, tile)])   # tile: 0.11 vs aten 0.10
    hint = next(hw for hw in fam.winners if hw.sizes == {"m": 128})

    def serve(m):
        runtime = substitute(base, {"m": m}, ("m",))
        dec, ranking = fam.similarity(runtime, fam.pool(runtime, 3)[0])
        assert ranking[0] == dec.winner
        return dec

    assert serve(100).winner == aten.name                        # lost by 10% at the hint: aten serves
    hint.selection.timings[tile.name] = 0.104
    dec = serve(100)
    assert dec.winner == tile.name and dec.hint == "m=128 #2" and "cuBLAS picks per shape" in dec.notes[0]
    assert serve(128).winner == aten.name                        # at its own hint aten's time is the measured one
    assert serve(200).winner == aten.name                        # 4x64 programs: a second round over the SMs
    assert serve(600).winner == aten.name                        # outside the hints (128 * 2 < 600)


def test_benchmark_guard_takes_the_measurement_at_a_timed_shape():
    """At a shape the bucket was timed at, the guard compares measured times: a bucket winner chosen on its worst
    ratio over the bucket's edges gives way where another choice ran more than 5% faster right there. Elsewhere
    aten's prediction comes from the nearest timed size, scaled by work."""
    from kernels.core.choice import Choice
    from kernels.dispatch.dynamic import inflation_guard, predicted_ms, substitute
    from kernels.space.heuristics import GemmConfig

    aten = Choice("aten", "aten_mm", "bf16")
    tma = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))
    choices = {aten.name: aten, tma.name: tma}
    base = problem(m=5334, n=4096, k=11008)
    at = {m: substitute(base, {"m": m}, ("m",)) for m in (4097, 5334, 8192)}
    probes = [(at[5334], {aten.name: 0.696, tma.name: 0.788}),
              (at[4097], {aten.name: 0.640, tma.name: 0.530}),        # an odd edge where cuBLAS picks badly
              (at[8192], {aten.name: 1.070, tma.name: 1.056})]
    winner, note = inflation_guard(tma.name, at[5334], probes, choices, frozenset({tma.name}))
    assert winner == aten.name and "at this very shape" in note
    assert predicted_ms(aten, at[5334], probes) == 0.696
    at_4623 = substitute(base, {"m": 4623}, ("m",))
    assert abs(predicted_ms(aten, at_4623, probes) - 0.640 * 4623 / 4097) < 1e-12
    assert inflation_guard(tma.name, at[8192], probes, choices, frozenset())[0] == tma.name    # within 5% there


def test_similarity_keeps_aten_on_compute_bound_shapes():
    """On compute-bound shapes cuBLAS held its time and a tied tile did not (H100, K=4096, N=12288: the M=4096
    hint's TMA runner-up ran M=3473 at 1.15x a per-M tune): aten keeps serving there."""
    from kernels.core.choice import Choice
    from kernels.core.selection import Selection
    from kernels.dispatch.dynamic import Dynamic, Family, HintWinner, resolve, substitute
    from kernels.space.heuristics import GemmConfig

    aten = Choice("aten", "aten_mm", "bf16")
    tma = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))
    base = problem(m=4096, n=12288, k=4096)
    fam = Family(base, resolve(Dynamic("m", hints=(1024, 4096), mode="similarity")))
    winners = []
    for m in (1024, 4096):
        hp = substitute(base, {"m": m}, ("m",))
        winners.append(HintWinner({"m": m}, hp, Selection(hp, aten.name, {aten.name: aten, tma.name: tma},
                                                          {aten.name: 0.6647, tma.name: 0.6581})))
    fam.winners = winners
    for m in (3473, 959):
        runtime = substitute(base, {"m": m}, ("m",))
        dec, _ = fam.similarity(runtime, fam.pool(runtime, 3)[0])
        assert dec.winner == aten.name and not dec.notes, (m, dec)


def test_bucket_benchmark_retimes_only_the_contenders(monkeypatch):
    """A bucket's benchmark goes through tuning's selection routine: every pool choice in a first pass, then only
    those within the tuning cutoff of the best (and the baseline) in the final round -- here the steady regime, the
    calls being over 0.1 ms. A choice several times slower is not a finalist, and its burst time is not reported as
    comparable with the finalists'."""
    from kernels.core.choice import Choice
    from kernels.dispatch import dynamic as dyn_mod
    from kernels.measure.steady import SteadyPlan
    from kernels.measure.timing import Timing
    from kernels.space.heuristics import GemmConfig
    from kernels.tune import final_round as fr

    speed = {"aten_mm": 0.72, "tma": 0.68, "tiny": 4.4}       # the tile 5.6% ahead: both rounds run
    choices = [Choice("aten", "aten_mm", "bf16"),
               Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8)),
               Choice("triton", "split_k", "bf16", GemmConfig(16, 64, 64, 4, 4), (("split", 4),))]
    key = {choices[0].name: "aten_mm", choices[1].name: "tma", choices[2].name: "tiny"}
    monkeypatch.setattr(dyn_mod, "build_launch", lambda p, c: (key[c.name], None))
    monkeypatch.setattr(dyn_mod, "checked_inputs", lambda *a: ((None, None), None))
    monkeypatch.setattr(dyn_mod, "verify_launch", lambda *a: None)
    monkeypatch.setattr(dyn_mod, "fresh_timing_sets", lambda *a: [(None, None)])
    monkeypatch.setattr(dyn_mod, "user_call", lambda launch, sets: launch)
    timing = lambda ms: Timing(ms, ms, ms, 5, 1)
    monkeypatch.setattr(fr, "measure_interleaved", lambda calls, *a, **k: (
        {n: timing(speed[c]) for n, c in calls.items()}, {}))
    monkeypatch.setattr(fr, "plan_for", lambda device: SteadyPlan(heat_ms=0, window_ms=10, rounds=3))
    finals, ran = [], []

    def windows(calls, n_sets, device):
        finals.append(sorted(calls.values()))
        return lambda name, untimed, timed: (ran.append(calls[name]), lambda: speed[calls[name]] * 1.01)[1]
    monkeypatch.setattr(fr, "window_clock", windows)
    got = dyn_mod.benchmark_choices(problem(m=5334, n=4096, k=11008), choices)
    # the final round: aten and the first pass's fastest other candidate (within CHALLENGER_WITHIN of aten)
    assert finals == [["aten_mm", "tma"]] and ran == ["aten_mm", "tma", "aten_mm", "tma", "aten_mm", "tma", "aten_mm"]
    assert got[choices[2].name].startswith("not a finalist (first pass 4400.0 us)")
    assert abs(got[choices[0].name] - 0.72 * 1.01) < 1e-12
    speed["aten_mm"] = 1.5                     # an outlying first pass: aten, the baseline, still joins the final round
    finals.clear()
    ran.clear()
    dyn_mod.benchmark_choices(problem(m=5334, n=4096, k=11008), choices)
    # the same duel, ended after its first round: the tile beats aten there by more than DUEL_CLEAR_WIN
    assert finals == [["aten_mm", "tma"]] and ran == ["aten_mm", "tma", "aten_mm"]
