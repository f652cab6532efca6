"""Lookup table: parser and serializer (hypothesis round trips, never raising), hand-written bad files, matching,
export from the selection store and the `lut` CLI."""
import json
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels.space import lut
from kernels.store.selections import SelectionStore
from kernels.core.choice import Choice
from kernels.space.heuristics import GemmConfig
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection


def problem(m=64, n=32, k=128, dtype="bf16", op="mm", gpu="NVIDIA H100 80GB HBM3", col_b=False):
    stride_b = (1, k) if col_b else (n, 1)
    return GemmProblem(op=op, m=m, n=n, k=k, dtype=dtype, out_dtype="int32" if op == "int_mm" else dtype,
                       stride_a=(k, 1), stride_b=stride_b, align_a=16, align_b=16, device="cuda", arch=90,
                       device_name=gpu)


# -- strategies ----------------------------------------------------------------------------------------------------
pos = st.integers(min_value=1, max_value=1 << 20)
configs = st.builds(GemmConfig, *(st.sampled_from([16, 32, 64, 128, 256]) for _ in range(3)),
                    st.integers(1, 6), st.sampled_from([2, 4, 8]), st.integers(1, 16))
# the parameters templates take (kernels.space.choice_rules): anything else is refused
params = st.one_of(st.just(()), st.tuples(st.tuples(st.just("split"), st.integers(1, 4096))),
                   st.tuples(st.tuples(st.just("sub"), st.integers(0, 1))))


@st.composite
def entries(draw):
    op = draw(st.sampled_from(["mm", "int_mm"]))
    dtype = draw(st.sampled_from(["bf16", "fp16", "fp32"] if op == "mm" else ["int8"]))
    templates = ["triton_mm", "aten_mm"] if op == "mm" else ["triton_int8_mm", "aten_int_mm"]
    refs = []
    for _ in range(draw(st.integers(1, 3))):
        template = draw(st.sampled_from(templates))
        if template.startswith("aten"):
            refs.append(lut.ChoiceRef(name=template))
        elif draw(st.booleans()):
            refs.append(lut.ChoiceRef(name=Choice("triton", template, dtype, draw(configs)).name))
        else:
            refs.append(lut.ChoiceRef(template=template, config=draw(configs), params=draw(params)))
    return lut.Entry(gpu=draw(st.sampled_from(["*", "NVIDIA H100 80GB HBM3", "NVIDIA H200"])), op=op, dtype=dtype,
                     m=draw(pos), n=draw(pos), k=draw(pos), mode=draw(st.sampled_from(lut.MODES)),
                     choices=tuple(dict.fromkeys(refs)), layout=draw(st.sampled_from(("",) + lut.LAYOUTS)),
                     precision=draw(st.sampled_from(lut.PRECISIONS)) if dtype == "fp32" else "")


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(1 << 40), 1 << 40),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)), max_leaves=20)
tables = st.builds(lambda es, meta: lut.Lut(entries=tuple(es), meta=meta), st.lists(entries(), max_size=5),
                   st.dictionaries(st.text(max_size=8), json_values, max_size=3))


@settings(max_examples=80, deadline=None)
@given(tables)
def test_round_trip_is_exact(table):
    with warnings.catch_warnings():
        warnings.simplefilter("error", lut.LutWarning)      # a table we produced parses without any warning
        again = lut.loads(lut.dumps(table))
    assert again == table
    assert lut.dumps(again) == lut.dumps(table)


def _mutations():
    """Valid documents with one field replaced by arbitrary JSON."""
    fields = ["gpu", "op", "dtype", "shape", "layout", "precision", "mode", "choices", "extra"]
    return st.tuples(tables, st.sampled_from(fields), json_values, st.integers(0, 4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(json_values, _mutations()))
def test_parser_never_raises_and_what_it_keeps_round_trips(case):
    if isinstance(case, tuple) and len(case) == 4 and isinstance(case[0], lut.Lut):
        table, fld, value, idx = case
        doc = table.to_json()
        if doc["entries"]:
            doc["entries"][idx % len(doc["entries"])][fld] = value
    else:
        doc = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lut.LutWarning)
        parsed = lut.parse(doc, "fuzz.json")
        again = lut.loads(lut.dumps(parsed))
    assert again == parsed


# -- hand-written bad files ---------------------------------------------------------------------------------------
CFG = {"block_m": 64, "block_n": 32, "block_k": 64, "num_stages": 3, "num_warps": 4}
GOOD = {"gpu": "*", "op": "mm", "dtype": "bf16", "shape": [64, 32, 128], "mode": "add",
        "choices": ["triton_mm_bf16_64x32x64_s3_w4_g8"]}


def _load_text(tmp_path, text):
    path = tmp_path / "table.json"
    path.write_text(text)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = lut.load(path)
    msgs = [str(w.message) for w in caught if issubclass(w.category, lut.LutWarning)]
    return table, msgs, str(path)


@pytest.mark.parametrize("text, expect", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "top level must be an object"),
    (json.dumps({"version": 1, "entries": {"a": 1}}), "entries must be a list"),
    (json.dumps({"version": "one", "entries": []}), "version must be a positive integer"),
    (json.dumps({"version": 99, "entries": []}), "newer than this kernels understands"),
    (json.dumps({"schema": "other", "version": 1, "entries": []}), "schema is 'other'"),
])
def test_bad_files_warn_with_the_file_name(tmp_path, text, expect):
    table, msgs, path = _load_text(tmp_path, text)
    assert table.entries == ()
    assert any(expect in m and path in m for m in msgs), msgs


def test_missing_file_is_a_warning_not_an_error(tmp_path):
    with pytest.warns(lut.LutWarning, match="cannot be read"):
        table = lut.load(tmp_path / "absent.json")
    assert table.entries == ()


@pytest.mark.parametrize("bad, expect", [
    ({"op": "conv"}, "op must be one of"),
    ({"op": {"x": 1}}, "op must be one of"),            # unhashable: it dropped the whole table (an attacker's probe)
    ({"op": ["mm"]}, "op must be one of"),
    ({"mode": ["add"]}, "mode must be one of"),
    ({"dtype": "int8"}, "dtype for mm must be one of"),
    ({"shape": [64, 32]}, "shape must be [M, N, K]"),
    ({"shape": [64, 32, -1]}, "shape must be [M, N, K]"),
    ({"shape": [64, True, 8]}, "shape must be [M, N, K]"),
    ({"mode": "replace"}, "mode must be one of"),
    ({"layout": "xx"}, "layout must be one of"),
    ({"choices": ["nonsense_kernel"]}, "does not start with a known template"),
    ({"choices": [{"template": "no_such_template", "config": {}}]}, "unknown template 'no_such_template'"),
    ({"choices": [{"template": "triton_mm", "config": {"block_m": 64, "blok_n": 2}}]}, "config fields must be among"),
    ({"choices": [{"template": "triton_mm", "config": {"block_m": 64}}]}, "config block_n = None"),
    ({"choices": [{"template": "triton_mm", "config": dict(CFG, num_warps=64)}]}, "config num_warps = 64"),
    # names and values are rendered into kernel source: only the parameters templates take, in their ranges
    ({"choices": [{"template": "triton_mm", "config": CFG, "params": [["x", "(a):pass\nimport os\ndef z"]]}]},
     "parameter 'x' unknown"),
    ({"choices": [{"template": "split_k", "config": CFG, "params": [["split", "4; import os"]]}]},
     "parameter 'split' value '4; import os' out of range"),
    ({"choices": [{"template": "split_k", "config": CFG, "params": [["split", 5000]]}]},
     "parameter 'split' value 5000 out of range"),
    ({"choices": [{"template": "split_k", "config": CFG, "params": {"split": 0}}]}, "out of range"),
    ({"choices": [{"template": "triton_int8_mm"}]}, "does not implement mm"),
    ({"choices": [{"template": "triton_mm", "cfg": {}}]}, "unknown field(s) ['cfg']"),
])
def test_bad_entries_are_skipped_and_the_rest_is_used(tmp_path, bad, expect):
    broken = dict(GOOD, **bad)
    doc = {"schema": "kernels-lut", "version": 1, "entries": [broken, GOOD]}
    table, msgs, path = _load_text(tmp_path, json.dumps(doc))
    assert len(table.entries) == 1 and table.entries[0].m == 64      # the good entry survives
    assert any(expect in m and path in m and "entry 0" in m for m in msgs), msgs


def test_unknown_entry_field_is_ignored_with_a_warning(tmp_path):
    doc = {"version": 1, "entries": [dict(GOOD, colour="red")]}
    table, msgs, _ = _load_text(tmp_path, json.dumps(doc))
    assert len(table.entries) == 1
    assert any("unknown field(s) ['colour']" in m for m in msgs)


# -- matching --------------------------------------------------------------------------------------------------------
def test_lookup_prefers_exact_gpu_and_layout_and_unions_their_choices():
    gpu = "NVIDIA H100 80GB HBM3"
    e_any = lut.Entry("*", "mm", "bf16", 64, 32, 128, "only", (lut.ChoiceRef(name="aten_mm"),))
    e_gpu = lut.Entry(gpu, "mm", "bf16", 64, 32, 128, "add", (lut.ChoiceRef(name="triton_mm_bf16_a"),))
    e_gpu_nn = lut.Entry(gpu, "mm", "bf16", 64, 32, 128, "add", (lut.ChoiceRef(name="triton_mm_bf16_b"),), "nn")
    e_gpu_nn2 = lut.Entry(gpu, "mm", "bf16", 64, 32, 128, "only", (lut.ChoiceRef(name="triton_mm_bf16_c"),), "nn")
    table = lut.Lut((e_any, e_gpu, e_gpu_nn, e_gpu_nn2))
    match = table.lookup(problem())
    assert match.entries == (2, 3) and match.mode == "only"
    assert [r.name for r in match.choices] == ["triton_mm_bf16_b", "triton_mm_bf16_c"]
    assert table.lookup(problem(col_b=True)).entries == (1,)              # nt: the layout-free GPU entry
    assert table.lookup(problem(gpu="NVIDIA A100")).entries == (0,)       # other GPU: only "*"
    assert table.lookup(problem(m=65)) is None
    assert table.lookup(problem(dtype="fp16")) is None


# -- export and CLI ------------------------------------------------------------------------------------------------
def _selection(p, times, created=1.0):
    choices = {n: Choice("triton", "triton_mm", p.dtype, GemmConfig(32, 32, 32, 2, 4)) for n in times}
    choices = {c.name + f"_{i}": c for i, c in enumerate(choices.values())}
    names = list(choices)
    timings = {names[i]: t for i, t in enumerate(times.values())}
    fastest = min((t, n) for n, t in timings.items() if isinstance(t, float))[1]
    return Selection(problem=p, winner=fastest, choices=choices, timings=timings, created=created)


def test_export_keeps_top_k_of_the_newest_selection_per_problem(tmp_path):
    store = SelectionStore(tmp_path / "sel")
    p1, p2 = problem(), problem(m=128, dtype="fp16")
    store.put("a", _selection(p1, {"x": 3.0, "y": 1.0, "z": 2.0, "w": "wrong result"}, created=1.0))
    store.put("b", _selection(p1, {"x": 5.0, "y": 4.0}, created=2.0))          # newer: this one is exported
    store.put("c", _selection(p2, {"x": 1.0}))
    (tmp_path / "sel" / "junk.json").write_text("{")
    table = lut.export_from_store(tmp_path / "sel", top_k=2)
    assert len(table.entries) == 2
    by_m = {e.m: e for e in table.entries}
    assert [r.name for r in by_m[64].choices] == ["triton_mm_bf16_32x32x32_s2_w4_g8_1",
                                                  "triton_mm_bf16_32x32x32_s2_w4_g8_0"]
    assert by_m[64].layout == "nn" and by_m[64].gpu == "NVIDIA H100 80GB HBM3"
    assert lut.loads(lut.dumps(table)) == table


def test_export_leaves_out_problems_with_an_epilogue(tmp_path, capsys):
    """A linear with a bias and the plain product of its shape were one entry (the newer's choices, aten_addmm first,
    pinned on the plain product too): an entry cannot say an epilogue, so those problems are left out and counted
    (an attacker's probe)."""
    import dataclasses

    from kernels.__main__ import main

    store = SelectionStore(tmp_path / "sel")
    plain = problem()
    store.put("a", _selection(plain, {"x": 1.0}, created=1.0))
    store.put("b", _selection(dataclasses.replace(plain, bias=True, activation="gelu"), {"x": 0.5}, created=2.0))
    table = lut.export_from_store(tmp_path / "sel", top_k=2)
    assert [(e.m, [r.name for r in e.choices]) for e in table.entries] == [(64, ["triton_mm_bf16_32x32x32_s2_w4_g8_0"])]
    assert table.meta["epilogue_left_out"] == 1
    assert main(["lut", "export", "--store", str(tmp_path / "sel"), "-o", str(tmp_path / "l.json")]) == 0
    assert "1 problem(s) with a bias or activation left out" in capsys.readouterr().err


def test_cli_export_then_check(tmp_path, capsys):
    from kernels.__main__ import main

    store = SelectionStore(tmp_path / "sel")
    store.put("a", _selection(problem(), {"x": 1.0}))
    out = tmp_path / "lut.json"
    assert main(["lut", "export", "--store", str(tmp_path / "sel"), "-o", str(out)]) == 0
    assert main(["lut", "check", str(out)]) == 0
    assert "1 usable entries" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1, "entries": [GOOD, dict(GOOD, op="conv")]}))
    assert main(["lut", "check", str(bad)]) == 1
    text = capsys.readouterr().out
    assert "warning:" in text and "entry 1" in text and "1 usable entries" in text
