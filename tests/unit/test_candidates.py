"""The narrowing stage (kernels.tune.candidates): lookup table add/only, name filters, benchmark space, settings,
fingerprint (one interpreter tune through it: tests/interp/test_candidates_tune.py)."""
import json

import pytest

from backends import get_backend
from kernels import config
from kernels.tune.autotune import candidates, fingerprint
from kernels.tune.candidates import narrow
from kernels.core.choice import Choice
from kernels.space.heuristics import GemmConfig
from kernels.space.perf_model import AnalyticModel
from kernels.core.problem import GemmProblem
from tests.helpers import write_lut

GPU = "NVIDIA H100 80GB HBM3"


def problem(m=4096, n=4096, k=4096, dtype="bf16", op="mm"):
    return GemmProblem(op=op, m=m, n=n, k=k, dtype=dtype, out_dtype="int32" if op == "int_mm" else dtype,
                       stride_a=(k, 1), stride_b=(n, 1), align_a=16, align_b=16, device="cuda", arch=90,
                       device_name=GPU)


def triton_choices(p, space="default"):
    return [c for c in get_backend("triton").choices(p, space)[0] if c.template == "triton_mm"]


def test_defaults_keep_everything():
    p = problem()
    cands = triton_choices(p)
    out = narrow(p, "triton", cands)
    assert out.kept == cands and not out.skipped and not out.notes


def test_lut_add_brings_in_a_choice_from_the_exhaustive_space_and_reports_unusable_ones(tmp_path):
    p = problem()
    extra = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 256, 32, 3, 8)).name
    write_lut(tmp_path, [{"gpu": GPU, "op": "mm", "dtype": "bf16", "shape": [4096, 4096, 4096], "mode": "add",
                          "choices": [extra,
                                      {"template": "triton_mm", "config": {"block_m": 128, "block_n": 128,
                                                                           "block_k": 64, "num_stages": 3,
                                                                           "num_warps": 4, "group_m": 4}},
                                      {"template": "triton_mm", "config": {"block_m": 256, "block_n": 256,
                                                                           "block_k": 128, "num_stages": 5,
                                                                           "num_warps": 8}}]}])
    cands = triton_choices(p)
    assert extra not in {c.name for c in cands}
    config.benchmark_space = 3
    out = narrow(p, "triton", cands)
    names = [c.name for c in out.kept]
    assert extra in names and "triton_mm_bf16_128x128x64_s3_w4_g4" in names   # table choices beyond the top 3
    assert len(names) == 5
    (label, why), = out.skipped.items()
    assert label.startswith("triton_mm_256x256x128") and "shared memory" in why
    assert any("from lookup table" in n for n in out.notes)
    # aten is another backend: the table names none of its choices in 'add' mode, so it is untouched
    aten = get_backend("aten").choices(p)[0]
    assert narrow(p, "aten", aten).kept == aten


def test_lut_only_restricts_and_leaves_other_backends_out(tmp_path):
    p = problem()
    name = triton_choices(p)[3].name
    write_lut(tmp_path, [{"gpu": "*", "op": "mm", "dtype": "bf16", "shape": [4096, 4096, 4096], "mode": "only",
                          "choices": [name]}])
    out = narrow(p, "triton", triton_choices(p))
    assert [c.name for c in out.kept] == [name]
    assert any("'only'" in n for n in out.notes)
    assert narrow(p, "aten", get_backend("aten").choices(p)[0]).kept == []
    assert narrow(problem(m=2048), "triton", triton_choices(problem(m=2048))).kept   # other shapes: untouched


def test_lut_only_with_nothing_usable_falls_back_to_the_usual_candidates(tmp_path):
    p = problem()
    write_lut(tmp_path, [{"gpu": "*", "op": "mm", "dtype": "bf16", "shape": [4096, 4096, 4096], "mode": "only",
                          "choices": ["triton_mm_bf16_999x1x1_s1_w1_g1"]}])
    cands = triton_choices(p)
    out = narrow(p, "triton", cands)
    assert out.kept == cands
    assert "triton_mm_bf16_999x1x1_s1_w1_g1" in out.skipped
    assert any("using the usual candidates" in n for n in out.notes)


def test_name_filters_never_drop_aten():
    p = problem()
    config.only = r"_128x128x\d+_"
    config.skip = "_s5_"
    out = narrow(p, "triton", triton_choices(p))
    assert out.kept and all("_128x128x" in c.name and "_s5_" not in c.name for c in out.kept)
    assert any("KERNELS_ONLY" in n for n in out.notes)
    aten = get_backend("aten").choices(p)[0]
    assert narrow(p, "aten", aten).kept == aten


def test_candidates_count_what_the_name_filters_left_out_in_every_backend():
    """CUTLASS filters by name inside its own choices (before its candidate limit); a tune counts those too, so that
    KERNELS_ONLY matching nothing warns there as well (autotune._warn_only_matched_nothing)."""
    p = problem()
    config.only = "^cutlas_"
    for name in ("triton", "cutlass"):
        got = candidates(get_backend(name), p)
        assert not got.kept and got.filtered > 0, name
    config.only = "^cutlass"
    got = candidates(get_backend("cutlass"), p)
    assert got.kept and got.filtered == 0


def test_top_k_keeps_the_models_best_in_original_order():
    p = problem()
    config.search_space = "exhaustive"
    config.benchmark_space = 5
    cands = triton_choices(p, "exhaustive")
    out = narrow(p, "triton", cands)
    pred = dict(zip((c.name for c in cands), AnalyticModel().predict(p, cands)))
    assert len(out.kept) == 5
    cutoff = max(pred[c.name] for c in out.kept)
    assert sum(1 for v in pred.values() if v < cutoff) <= 4
    assert [c.name for c in out.kept] == [c.name for c in cands if c in out.kept]
    assert any(f"5 of {len(cands)}" in n and "analytic" in n for n in out.notes)
    assert not out.skipped                           # summarized in a note, not one line per candidate


def test_top_k_takes_an_already_built_choice_predicted_within_the_warm_tie(monkeypatch):
    from kernels.tune.candidates import WARM_TIE

    p = problem()
    config.search_space = "exhaustive"
    config.benchmark_space = 5
    cands = triton_choices(p, "exhaustive")
    pred = dict(zip((c.name for c in cands), AnalyticModel().predict(p, cands)))
    cold = narrow(p, "triton", cands).kept
    # a pick with a not-picked twin of its template predicted within the tie, and one predicted just beyond it
    pairs = [(c, o) for c in cold for o in cands if o not in cold and o.template == c.template and o.name != c.name
             and abs(pred[o.name] / pred[c.name] - 1) <= WARM_TIE]
    assert pairs, "no twin within the tie in the exhaustive space"
    victim, twin = pairs[0]
    backend_type = type(get_backend("triton"))
    monkeypatch.setattr(backend_type, "built", lambda self, prob, chs: {twin.name})
    warm = narrow(p, "triton", cands)
    assert twin in warm.kept and victim not in warm.kept and len(warm.kept) == 5
    assert any("1 replaced by an already built choice" in n for n in warm.notes)
    # built picks stay; choices predicted beyond the tie never come in, built or not
    far = [o for o in cands if o not in cold and abs(pred[o.name] / pred[victim.name] - 1) > 2 * WARM_TIE]
    monkeypatch.setattr(backend_type, "built", lambda self, prob, chs: {c.name for c in cold} | {o.name for o in far})
    assert narrow(p, "triton", cands).kept == cold


def test_default_benchmark_space_and_sample_are_deterministic():
    p = problem()
    config.search_space = "exhaustive"
    cands = triton_choices(p, "exhaustive")
    config.benchmark_space = "default"
    # as many as the whole backend's default list (every Triton template's), whatever the candidates passed
    assert len(narrow(p, "triton", cands).kept) == len(get_backend("triton").choices(p, "default")[0])
    config.benchmark_space = "sample:7"
    a = narrow(p, "triton", cands).kept
    b = narrow(p, "triton", list(reversed(cands))).kept
    defaults = {c.name for c in triton_choices(p, "default")}
    assert {c.name for c in a} == {c.name for c in b}
    assert defaults <= {c.name for c in a} and len(a) == len(defaults) + 7


def test_explore_space_times_the_models_favourites_and_a_draw_per_problem():
    from kernels.space.ranking import model_for, top_k

    config.search_space = "exhaustive"
    config.benchmark_space = "explore:20"
    p, q = problem(), problem(m=512, n=1024, k=8192)
    cands_p, cands_q = triton_choices(p, "exhaustive"), triton_choices(q, "exhaustive")
    a = narrow(p, "triton", cands_p)
    again = narrow(p, "triton", list(reversed(cands_p)))
    names = {c.name for c in a.kept}
    assert names == {c.name for c in again.kept}                       # deterministic, order-free
    defaults = {c.name for c in triton_choices(p, "default")}
    model, _ = model_for(p)
    favourites = {cands_p[i].name for i in top_k(model, p, cands_p, 10)}
    assert defaults <= names and favourites <= names
    assert len(names) == len(defaults | favourites) + 10               # the rest of the 20 drawn
    assert any("explore:20" in n for n in a.notes)
    drawn_p = names - defaults - favourites
    b = narrow(q, "triton", cands_q)
    favourites_q = {cands_q[i].name for i in top_k(model_for(q)[0], q, cands_q, 10)}
    drawn_q = {c.name for c in b.kept} - {c.name for c in triton_choices(q, "default")} - favourites_q
    assert drawn_p != drawn_q                                           # salted by the problem, unlike sample:N
    with pytest.raises(ValueError):
        config.benchmark_space = "explore:0"


def test_settings_parse_and_preset():
    assert config.search_space == "default" and config.benchmark_space == "all"
    config.preset = "fast"
    assert config.search_space == "exhaustive" and config.benchmark_space == 5
    config.benchmark_space = "12"
    assert config.benchmark_space == 12
    for bad in ("0", "some", "sample:x", "-3"):
        with pytest.raises(ValueError):
            config.benchmark_space = bad
    config.skip = "a{1,2},b"
    assert config.skip == ("a{1,2}", "b")
    with pytest.raises(ValueError):
        config.only = "("
    with pytest.raises(ValueError):
        config.perf_model = "magic"


def test_fingerprint_changes_only_when_narrowing_is_configured(tmp_path):
    base = fingerprint(("aten", "triton"))
    assert set(base) == {"kernels", "torch", "cuda", "triton", "templates", "backends", "space"}
    config.benchmark_space = 5
    assert fingerprint(("aten", "triton"))["benchmark_space"] == "5"
    config.benchmark_space = "all"
    path = write_lut(tmp_path, [])
    first = fingerprint(("aten",))["lut"]
    path.write_text(json.dumps({"version": 1, "entries": [{"op": "mm", "dtype": "bf16", "shape": [1, 2, 3],
                                                           "choices": ["aten_mm"]}]}))
    assert fingerprint(("aten",))["lut"] != first
