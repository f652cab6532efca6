"""Performance models: analytic behaviour, the learned model on a SYNTHETIC dataset generated here (never measured
data), reproducibility, staleness fallback, Spearman, dataset CSV and the model CLI (collection on CPU:
tests/interp/test_perf_collect.py)."""
import json
import math
import random

import pytest

from kernels import config
from kernels.space import perf_learned
from kernels.core.choice import Choice
from kernels.space.heuristics import GemmConfig, candidate_configs
from tools.perf_model.data import Row, append_rows, parse_shapes, read_dataset
from tools.perf_model.evaluate import score, spearman
from kernels.space.perf_model import AnalyticModel
from kernels.space.ranking import model_for
from kernels.core.problem import GemmProblem
from tests.helpers import REPO

GPU = "NVIDIA H100 80GB HBM3"


def problem(m=4096, n=4096, k=4096, dtype="bf16", op="mm", gpu=GPU):
    return GemmProblem(op=op, m=m, n=n, k=k, dtype=dtype, out_dtype="int32" if op == "int_mm" else dtype,
                       stride_a=(k, 1), stride_b=(n, 1), align_a=16, align_b=16, device="cuda", arch=90,
                       device_name=gpu)


def ms(p, cfg, template="triton_mm"):
    return AnalyticModel().predict(p, [Choice("triton", template, p.dtype, cfg)])[0]


def test_analytic_model_behaviour():
    big = GemmConfig(128, 256, 64, 3, 8)
    assert ms(problem(8192, 8192, 8192), big) > 6 * ms(problem(4096, 4096, 4096), big)
    # wave quantization: 132 tiles fill the SMs once, 133 need a second wave
    one = ms(problem(128 * 132, 256, 8192), big)
    two = ms(problem(128 * 133, 256, 8192), big)
    assert two > 1.5 * one
    # pipeline depth and tile efficiency
    assert ms(problem(), GemmConfig(128, 128, 64, 1, 4)) > ms(problem(), GemmConfig(128, 128, 64, 3, 4))
    assert ms(problem(), GemmConfig(32, 32, 32, 3, 4)) > 3 * ms(problem(), GemmConfig(128, 128, 64, 3, 4))
    # int8 tensor cores are twice as fast as bf16 ones (int8 warpgroup MMA needs a K-major B: the kmajor template)
    i8 = problem(dtype="int8", op="int_mm")
    assert ms(i8, big, "triton_kmajor_int8_mm") < 0.7 * ms(problem(), big)
    # never under the roofline
    p = problem()
    assert ms(p, big) * 1e-3 >= p.flops / 989e12
    # aten has a prediction, unknown choices have none
    assert AnalyticModel().predict(p, [Choice("aten", "aten_mm", "bf16"),
                                       Choice("cutlass", "cutlass3x_sm90_mm", "bf16", None, (("", "junk"),))])[1] is None


def test_analytic_top_choices_on_a_large_square_problem_are_large_tiles():
    p = problem()
    cands = [Choice("triton", "triton_mm", "bf16", c) for c in candidate_configs(p, "triton_mm", "exhaustive")]
    pred = AnalyticModel().predict(p, cands)
    top = [c for _, c in sorted(zip(pred, cands), key=lambda x: x[0])[:5]]
    assert all(c.config.block_m * c.config.block_n >= 128 * 128 for c in top)


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)
    assert math.isnan(spearman([1], [2]))


# -- SYNTHETIC data: the analytic time times a hidden, config-dependent factor the learned model must pick up ---------
def synthetic_truth(p, c):
    cfg = c.config
    factor = 1.0
    if cfg.num_warps == 8 and cfg.block_m * cfg.block_n <= 64 * 64:
        factor *= 2.0                 # "too many warps for a small tile"
    if cfg.num_stages >= 5:
        factor *= 1.6                 # "deep pipelines spill"
    if cfg.block_k == 16:
        factor *= 1.4
    return ms(p, cfg) * factor


SYN_TRAIN = [(512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (16, 4096, 4096), (64, 12288, 4096),
             (128, 128, 16384), (1000, 3000, 2000), (4096, 1024, 512)]
SYN_TEST = [(768, 768, 768), (32, 8192, 4096), (3000, 2000, 1000), (256, 256, 8192)]


def synthetic_rows(shapes, per_shape=60, seed=0):
    rng = random.Random(seed)
    rows = []
    for m, n, k in shapes:
        p = problem(m, n, k, gpu="SYNTHETIC-GPU")
        cfgs = candidate_configs(p, "triton_mm", "exhaustive")
        for cfg in rng.sample(cfgs, min(per_shape, len(cfgs))):
            c = Choice("triton", "triton_mm", "bf16", cfg)
            rows.append((p, c, synthetic_truth(p, c) * math.exp(rng.gauss(0, 0.02))))
    return rows


def test_learned_model_fits_reproducibly_and_beats_analytic_on_held_out_synthetic_shapes():
    train = synthetic_rows(SYN_TRAIN)
    meta = {"gpu": "SYNTHETIC-GPU", "triton": perf_learned._triton_version(), "synthetic": True}
    params = perf_learned.fit(train, meta, steps=400)
    assert params == perf_learned.fit(train, meta, steps=400)          # same data + seed -> same parameters
    model = perf_learned.LearnedModel(params)
    test = synthetic_rows(SYN_TEST, seed=1)
    from tools.perf_model.data import Row
    rows = [Row(p, c, t, "ok", p.device_name, "", "") for p, c, t in test]
    learned, analytic = score(model, rows, 5), score(AnalyticModel(), rows, 5)
    assert learned.mean_spearman > analytic.mean_spearman + 0.05
    assert learned.mean_spearman > 0.85
    assert learned.geomean_regret <= analytic.geomean_regret


def test_model_for_uses_fresh_learned_models_and_falls_back_when_stale(tmp_path):
    meta = {"gpu": GPU, "triton": perf_learned._triton_version()}
    path = tmp_path / "m.json"
    perf_learned.save(perf_learned.fit(synthetic_rows(SYN_TRAIN[:3], 20), meta, steps=50), path)
    config.perf_model = str(path)
    model, note = model_for(problem())
    assert model.name == "learned" and note == ""
    assert all(t > 0 for t in model.predict(problem(), [Choice("triton", "triton_mm", "bf16",
                                                               GemmConfig(64, 64, 32, 3, 4))]))
    model, note = model_for(problem(gpu="NVIDIA H200"))
    assert model.name == "analytic" and "stale" in note and "NVIDIA H200" in note
    config.perf_model = "analytic"
    assert model_for(problem())[0].name == "analytic"
    (tmp_path / "bad.json").write_text("{}")
    config.perf_model = str(tmp_path / "bad.json")
    model, note = model_for(problem())
    assert model.name == "analytic" and "unusable" in note
    # a file whose meta or scaling is malformed is unusable at load, not a failure in the middle of a tune
    good = json.loads(path.read_text())
    for change, why in [({"meta": dict(meta, gpu=7)}, "gpu and triton are strings"),
                        ({"x_std": [0.0] * len(good["x_std"])}, "x_std positive")]:
        (tmp_path / "bad.json").write_text(json.dumps(dict(good, **change)))
        model, note = model_for(problem())
        assert model.name == "analytic" and "unusable" in note and why in note, note


def test_dataset_csv_round_trip_and_cli_train_eval(tmp_path, capsys):
    from tools.perf_model.__main__ import main
    from tools.perf_model.data import COLUMNS

    path = tmp_path / "synthetic.csv"
    rows = []
    for p, c, t in synthetic_rows(SYN_TRAIN[:4], 30):
        rows.append({"gpu": p.device_name, "arch": p.arch, "device": p.device, "triton": "3.6.0", "torch": "x",
                     "kernels": "0", "date": "synthetic", "op": p.op, "dtype": p.dtype, "out_dtype": p.out_dtype,
                     "precision": "", "m": p.m, "n": p.n, "k": p.k, "stride_a": f"{p.k}:1", "stride_b": f"{p.n}:1",
                     "backend": "triton", "template": c.template, "name": c.name,
                     "choice": json.dumps(c.as_dict()), "ms": f"{t:.6g}", "status": "ok"})
    rows.append(dict(rows[0], ms="", status="wrong result: x"))
    append_rows(path, rows)
    with open(path, "a") as f:
        f.write("garbage,row\n")
    back, bad = read_dataset([path])
    assert len(back) == len(rows) and len(bad) == 1 and set(COLUMNS) >= {"gpu", "ms"}
    assert back[0].choice.name == rows[0]["name"] and back[-1].ms is None
    import gzip
    packed = tmp_path / "synthetic.csv.gz"                  # committed ground-truth files are gzip-compressed
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_dataset([packed]) == (back, [b.replace(str(path), str(packed)) for b in bad])
    out = tmp_path / "model.json"
    assert main(["train", "--data", str(path), "--out", str(out), "--steps", "60",
                 "--holdout-frac", "0.25", "--note", "SYNTHETIC test data"]) == 0
    text = capsys.readouterr().out
    assert "held-out problems (1)" in text and "learned:" in text and "analytic:" in text
    params = json.loads(out.read_text())
    assert params["meta"]["gpu"] == "SYNTHETIC-GPU" and params["meta"]["triton"] == "3.6.0"
    assert params["meta"]["note"] == "SYNTHETIC test data"
    assert main(["eval", "--data", str(path), "--model", str(out)]) == 0
    assert "top-5 regret" in capsys.readouterr().out
    assert main(["eval", "--data", str(path), "--model", str(out), "--dtypes", "int8"]) == 0
    assert "0 problems" in capsys.readouterr().out          # the synthetic data is all bf16
    assert main(["cv", "--data", str(path), "--steps", "30", "--shares", "0,0.4", "--members", "2",
                 "--jobs", "2"]) == 0
    text = capsys.readouterr().out
    assert "leave-one-problem-out over 4 problems" in text and "analytic:" in text
    assert all(f"learned+{s}%a/{e}:" in text for s in (0, 40) for e in ("mean", "optimistic"))
    # as users run it: from `python -m kernels` the folds' function must still import in spawned workers
    import os
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "tools.perf_model", "cv", "--data", str(path), "--steps", "10",
                           "--shares", "0", "--members", "1", "--ensembles", "mean", "--jobs", "2"],
                          capture_output=True, text=True, timeout=300, cwd=str(REPO),
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0 and "leave-one-problem-out over 4 problems" in proc.stdout, proc.stderr[-2000:]


def test_parse_shapes(tmp_path):
    assert parse_shapes("16x32x48,1x2x3") == [(16, 32, 48), (1, 2, 3)]
    assert len(parse_shapes("heldout")) >= 20
    f = tmp_path / "s.csv"
    f.write_text("M,N,K\n16,32,48\n# comment\n8x8x8\n")
    assert parse_shapes(str(f)) == [(16, 32, 48), (8, 8, 8)]
    with pytest.raises(ValueError):
        parse_shapes("16x32")


def test_regret_as_tuning_runs_it_counts_aten_on_both_sides():
    """Tuning benchmarks aten beside the model's picks: a miss by the model costs only what aten does not cover."""
    p = problem(m=1024, n=1024, k=1024)
    cfgs = [GemmConfig(128, 128, 64, 3, 4), GemmConfig(64, 64, 32, 2, 4), GemmConfig(32, 32, 32, 2, 4)]
    pred = AnalyticModel().predict(p, [Choice("triton", "triton_mm", "bf16", c) for c in cfgs])
    order = sorted(range(3), key=lambda i: pred[i])
    truth = {order[0]: 2.0, order[1]: 1.5, order[2]: 1.0}     # the model's favourite is measured slowest
    rows = [Row(p, Choice("triton", "triton_mm", "bf16", c), truth[i], "ok", GPU, "", "") for i, c in enumerate(cfgs)]
    alone = score(AnalyticModel(), rows, 1).problems[0]
    assert alone.regret == pytest.approx(2.0) and alone.regret_tuned is None
    with_aten = rows + [Row(p, Choice("aten", "aten_mm", "bf16"), 1.2, "ok", GPU, "", "")]
    tuned = score(AnalyticModel(), with_aten, 1)
    assert tuned.problems[0].regret_tuned == pytest.approx(1.2)       # min(2.0, aten 1.2) / min(1.0, 1.2)
    assert tuned.geomean_regret_tuned == pytest.approx(1.2) and "as tuning does" in tuned.summary()


def test_top_k_with_a_learned_model_gives_analytic_favourites_a_share():
    from kernels.space.ranking import ANALYTIC_SHARE, top_k

    class Reversed:          # a "learned" model that ranks exactly opposite to the analytic one
        name = "learned"

        def predict(self, p, choices):
            return [-t for t in AnalyticModel().predict(p, choices)]

    p = problem()
    cands = [Choice("triton", "triton_mm", "bf16", c) for c in candidate_configs(p, "triton_mm", "exhaustive")][:40]
    analytic_first = top_k(AnalyticModel(), p, cands, 5)
    picked = top_k(Reversed(), p, cands, 5)
    assert len(picked) == len(set(picked)) == 5
    n_analytic = round(ANALYTIC_SHARE * 5)
    assert set(analytic_first[:n_analytic]) <= set(picked)                         # the analytic share
    assert set(top_k(AnalyticModel(), p, cands, 40)[-(5 - n_analytic):]) <= set(picked)   # the learned share
    assert sorted(top_k(Reversed(), p, cands[:3], 5)) == [0, 1, 2]          # fewer choices than k: all of them


def test_analytic_model_charges_padding_its_copies_and_misaligned_loads_their_width():
    from kernels.space.perf_model import MISALIGNED_OPERAND_FACTOR

    cfg = GemmConfig(128, 128, 64, 4, 8)
    odd = problem(2047, 2047, 2047, dtype="int8", op="int_mm")
    plain, padded = (ms(odd, cfg, t) for t in ("triton_kmajor_int8_mm", "triton_padded_int8_mm"))
    assert padded < plain                                     # two narrow operands cost more than two copies
    aligned = problem(2048, 2048, 2048, dtype="int8", op="int_mm")
    assert ms(aligned, cfg, "triton_kmajor_int8_mm") * MISALIGNED_OPERAND_FACTOR ** 2 == pytest.approx(plain, rel=0.02)
    one_side = problem(1000, 3000, 2000, dtype="int8", op="int_mm")      # B's rows 3000 bytes: off 16
    import dataclasses
    col_b = dataclasses.replace(one_side, stride_b=(1, 2000))             # B's columns 2000 bytes: aligned
    assert ms(one_side, cfg, "triton_kmajor_int8_mm") == pytest.approx(MISALIGNED_OPERAND_FACTOR *
                                                                        ms(col_b, cfg, "triton_kmajor_int8_mm"))


def test_analytic_model_gives_int8_warpgroup_mma_only_to_a_k_major_b():
    import dataclasses

    cfg = GemmConfig(128, 128, 128, 3, 8)
    row_b = problem(4096, 4096, 4096, dtype="int8", op="int_mm")
    col_b = dataclasses.replace(row_b, stride_b=(1, 4096))
    assert ms(row_b, cfg, "triton_int8_mm") > ms(row_b, cfg, "triton_kmajor_int8_mm")
    assert ms(row_b, cfg, "triton_tma_int8_mm") > ms(col_b, cfg, "triton_tma_int8_mm")
    assert ms(col_b, cfg, "triton_int8_mm") == pytest.approx(ms(row_b, cfg, "triton_kmajor_int8_mm"))
    assert ms(problem(), cfg) == pytest.approx(ms(problem(), cfg, "triton_tma_mm"))        # bf16: both wgmma


class Fixed:
    """A "learned" model whose predictions are given per choice index."""
    name = "learned"

    def __init__(self, times):
        self.times = times

    def predict(self, p, choices):
        return list(self.times)


def test_top_k_hedges_with_the_second_familys_best_when_it_is_close():
    from kernels.space.ranking import HEDGE_RATIO, family_heads, top_k

    p = problem(1500, 1500, 1500, dtype="int8", op="int_mm")
    cfgs = candidate_configs(p, "triton_int8_mm", "exhaustive")[:7]
    cands = [Choice("triton", "triton_int8_mm", "int8", c) for c in cfgs[:6]]
    cands.append(Choice("triton", "triton_padded_int8_mm", "int8", cfgs[6]))
    close = [1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]          # the one padded choice predicted 1.6x the favourite
    assert family_heads(cands, close, 2, HEDGE_RATIO) == [0, 6]
    assert top_k(Fixed(close), p, cands, 5, analytic_share=0) == [0, 6, 1, 2, 3]
    far = close[:6] + [HEDGE_RATIO * 1.01]                # predicted beyond the ratio: the model is trusted
    assert top_k(Fixed(far), p, cands, 5, analytic_share=0) == [0, 1, 2, 3, 4]
    # only the second family: a third family's best does not take a place
    third = cands[:5] + [Choice("triton", "triton_kmajor_int8_mm", "int8", cfgs[5]), cands[6]]
    assert family_heads(third, close, 2, HEDGE_RATIO) == [0, 5]
    assert top_k(Fixed(close), p, third, 5, analytic_share=0) == [0, 5, 1, 2, 3]


class KnowsOnlyMm(Fixed):
    """A learned model trained on triton_mm only; the other templates get absurdly fast (other-scale) times."""

    def knows(self, choice):
        return choice.template == "triton_mm"


def test_top_k_gives_templates_the_learned_model_has_not_seen_one_place_judged_on_the_analytic_scale():
    from kernels.space.ranking import top_k

    p = problem()
    cfgs = candidate_configs(p, "triton_mm", "default")
    mm = [Choice("triton", "triton_mm", "bf16", c) for c in cfgs]
    best = min(range(len(mm)), key=lambda i: ms(p, cfgs[i]))
    close = Choice("triton", "triton_tma_mm", "bf16", cfgs[best])              # same tile: analytic ties
    tiny = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(16, 16, 16, 2, 4))   # analytic: far slower
    cands = mm + [close, tiny]
    times = [1.0 + (0 if i == best else 0.01 * (i + 1)) for i in range(len(mm))] + [1e-6, 1e-6]   # agrees on best
    picked = top_k(KnowsOnlyMm(times), p, cands, 5, analytic_share=0)
    assert len(picked) == 5 and len(mm) in picked and len(mm) + 1 not in picked
    picked = top_k(KnowsOnlyMm(times), p, mm + [tiny], 5, analytic_share=0)
    assert len(mm) not in picked                                  # beyond HEDGE_RATIO on the analytic scale
    # nor do they come in through the analytic model's share: one place in all
    many = [Choice("triton", "triton_tma_mm", "bf16", c) for c in cfgs]
    picked = top_k(KnowsOnlyMm(times[:len(mm)] + [1e-6] * len(many)), p, mm + many, 5, analytic_share=0.4)
    assert len(picked) == 5 and sum(i >= len(mm) for i in picked) == 1
    only_unseen = [close, tiny]
    assert top_k(KnowsOnlyMm([1e-6, 1e-6]), p, only_unseen, 1, analytic_share=0) == [0]   # analytic ranks them


class TwoMembers:
    """A learned ensemble whose members each expect a different choice to be fastest; their mean expects a third."""
    name = "learned"
    members = [[1.0, 5.0, 5.0, 5.0, 1.8, 5.0, 2.0],
               [5.0, 5.0, 1.5, 5.0, 5.0, 3.0, 2.0]]

    def predict_members(self, p, choices):
        return [list(m) for m in self.members]

    def predict(self, p, choices):
        return [math.sqrt(a * b) for a, b in zip(*self.members)]


def test_top_k_ranks_an_ensemble_by_its_fastest_member():
    from kernels.space.ranking import optimistic, top_k

    assert optimistic([[3.0, 1.0, None], [2.0, 4.0, 1.0]]) == [2.0, 1.0, None]
    p = problem()
    cands = [Choice("triton", "triton_mm", "bf16", c) for c in candidate_configs(p, "triton_mm", "exhaustive")][:7]
    assert top_k(TwoMembers(), p, cands, 3, analytic_share=0, ensemble="mean") == [6, 0, 2]
    assert top_k(TwoMembers(), p, cands, 3, analytic_share=0, ensemble="optimistic") == [0, 2, 4]
    # with an analytic share the ensemble fills the learned places only (3 of 5), then the analytic favourites
    analytic = top_k(AnalyticModel(), p, cands, 7)
    picked = top_k(TwoMembers(), p, cands, 5, analytic_share=0.4, ensemble="optimistic")
    assert picked[:3] == [0, 2, 4] and picked[3:] == [i for i in analytic if i not in (0, 2, 4)][:2]


def test_learned_member_predictions_average_to_the_prediction():
    meta = {"gpu": "SYNTHETIC-GPU", "triton": perf_learned._triton_version()}
    model = perf_learned.LearnedModel(perf_learned.fit(synthetic_rows(SYN_TRAIN[:3], 20), meta, steps=30, members=3))
    p = problem(1024, 1024, 1024, gpu="SYNTHETIC-GPU")
    cands = [Choice("aten", "aten_mm", "bf16")] + [Choice("triton", "triton_mm", "bf16", c)
                                                     for c in candidate_configs(p, "triton_mm", "exhaustive")[:8]]
    members, mean = model.predict_members(p, cands), model.predict(p, cands)
    assert len(members) == 3 and all(m[0] == mean[0] for m in members)         # aten: the analytic estimate
    for i in range(1, len(cands)):
        assert math.exp(sum(math.log(m[i]) for m in members) / 3) == pytest.approx(mean[i])
        assert len({m[i] for m in members}) == 3                              # members differ by their seed


def test_learned_model_keeps_each_training_problems_winners_and_finds_the_nearest_of_its_class():
    rows = synthetic_rows(SYN_TRAIN[:3], 20)
    meta = {"gpu": "SYNTHETIC-GPU", "triton": perf_learned._triton_version()}
    params = perf_learned.fit(rows, meta, steps=30, members=1)
    winners = {tuple(w["mnk"]): w["winner"] for w in params["winners"]}
    assert set(winners) == set(SYN_TRAIN[:3])
    for mnk, winner in winners.items():
        assert winner == min((t, c.name) for p, c, t in rows if (p.m, p.n, p.k) == mnk)[1]
    model = perf_learned.LearnedModel(json.loads(json.dumps(params)))      # as saved and loaded
    near_1024 = problem(1100, 1000, 960, gpu="SYNTHETIC-GPU")
    assert model.neighbour_winners(near_1024, 1) == [winners[(1024, 1024, 1024)]]
    assert model.neighbour_winners(near_1024, 3) == [winners[s] for s in [(1024, 1024, 1024), (512, 512, 512),
                                                                          (2048, 2048, 2048)]]
    col_b = GemmProblem(**{**near_1024.__dict__, "stride_b": (1, 960)})     # another layout: another template set
    assert model.neighbour_winners(col_b, 3) == []
    del params["winners"]                                                   # a model saved before winners existed
    assert perf_learned.LearnedModel(params).neighbour_winners(near_1024, 3) == []


def test_top_k_gives_the_nearest_training_problems_winners_places_even_when_predicted_slow():
    from kernels.space.ranking import NEIGHBOUR_PLACES, top_k

    p = problem()
    cands = [Choice("triton", "triton_mm", "bf16", c) for c in candidate_configs(p, "triton_mm", "exhaustive")][:40]

    class Remembers:          # predicts the analytic times; remembers three winners it predicts among the slowest
        name = "learned"

        def predict(self, p, choices):
            return AnalyticModel().predict(p, choices)

        def neighbour_winners(self, p, n):
            return [slowest[0].name, slowest[1].name, slowest[2].name, "not_a_candidate"][:n]

    pred = AnalyticModel().predict(p, cands)
    slowest = sorted(cands, key=lambda c: -pred[cands.index(c)])
    picked = top_k(Remembers(), p, cands, 5, analytic_share=0)
    assert len(picked) == len(set(picked)) == 5
    winners = [cands.index(c) for c in slowest[:3]]
    # the nearest problems' winners get the places, however slow the model expects them
    assert sorted(i for i in picked if i in winners) == sorted(winners[:NEIGHBOUR_PLACES])
    assert not set(top_k(Remembers(), p, cands, 2, analytic_share=0)) & set(winners)   # k <= 2: the model's own


def test_the_neighbour_place_comes_out_of_the_analytic_share_while_that_keeps_one():
    from kernels.space.ranking import top_k

    p = problem()
    cands = [Choice("triton", "triton_mm", "bf16", c) for c in candidate_configs(p, "triton_mm", "exhaustive")][:40]
    pred = AnalyticModel().predict(p, cands)
    fastest = sorted(range(len(cands)), key=lambda i: (pred[i], i))

    class ReversedRemembers:   # ranks opposite to the analytic model; remembers one mid-field winner
        name = "learned"

        def predict(self, p, choices):
            return [-t for t in AnalyticModel().predict(p, choices)]

        def neighbour_winners(self, p, n):
            return [cands[fastest[20]].name]

    picked = top_k(ReversedRemembers(), p, cands, 5, analytic_share=0.4)
    # 3 learned (the analytic model's slowest), the winner, 1 analytic favourite (the share was 2)
    assert sorted(picked) == sorted([fastest[-1], fastest[-2], fastest[-3], fastest[20], fastest[0]])
    picked = top_k(ReversedRemembers(), p, cands, 5, analytic_share=0)
    assert sorted(picked) == sorted([fastest[-1], fastest[-2], fastest[-3], fastest[-4], fastest[20]])


def test_dataset_rows_label_every_candidate_with_its_first_pass():
    """A steady final round times its two finalists in 1 s windows at the power cap (slower than a first pass); the
    dataset labels everyone by the first pass, the regime the model ranks for."""
    from kernels.core.selection import Selection
    from tools.perf_model.data import selection_rows
    from tests.helpers import problem

    from kernels.tune.final_round import not_verified

    names = ("aten_mm", "tile_duelled", "tile_first_pass_only", "broken", "tile_unverified")
    sel = Selection(problem(), "aten_mm", {n: Choice("aten", n, "bf16") for n in names},
                    timings={"aten_mm": 0.2025, "tile_duelled": 0.2104, "tile_first_pass_only": 0.1810,
                             "broken": "failed verification", "tile_unverified": not_verified(0.2301)},
                    details={"aten_mm": {"first_pass_ms": 0.2050, "final_ms": 0.2025},
                             "tile_duelled": {"first_pass_ms": 0.1830, "final_ms": 0.2104},
                             "tile_unverified": {"median_ms": 0.2301}}, regime="steady")
    rows = {r["name"]: r for r in selection_rows(sel, {})}
    assert {n: rows[n]["ms"] for n in names} == {"aten_mm": "0.205", "tile_duelled": "0.183",
                                                 "tile_first_pass_only": "0.181", "broken": "",
                                                 "tile_unverified": ""}
    assert rows["broken"]["status"] == "failed verification"
    assert rows["tile_unverified"]["status"].startswith("not verified")     # no label: it may be fast for being wrong
