"""bench.sustained without a GPU: problems and sets, arguments and bad input, the figures (speedup, regret, the
tuner-vs-loops ranking check, geomeans) and the table, on fake loop results. Its measurement through the
interpreter: tests/interp/test_bench_sustained_runs.py."""
import json
import re

import pytest
import torch

from bench import sustained as bs
from bench import sustained_report as br
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.selection import Selection
from tests.helpers import problem


# -- problems, sets, arguments ---------------------------------------------------------------------------------------
def test_problems_parse_with_layout_default_nn():
    specs = bs.parse_problems("bf16:4096x4096x4096:nn, INT8:1024x22016x4096:nt,fp16:64x32x16")
    assert specs == [bs.ProblemSpec("bf16", 4096, 4096, 4096, "nn"), bs.ProblemSpec("int8", 1024, 22016, 4096, "nt"),
                     bs.ProblemSpec("fp16", 64, 32, 16, "nn")]
    assert [s.op for s in specs] == ["mm", "int_mm", "mm"]
    assert specs[1].label() == "int8 1024x22016x4096 nt"
    assert bs.parse_problems("bf16:8x8x8,bf16:8x8x8:nn") == [bs.ProblemSpec("bf16", 8, 8, 8)]   # one problem once


@pytest.mark.parametrize("text, says", [
    ("fp4:8x8x8", "unknown dtype 'fp4'"), ("bf16:8x8x8:nx", "unknown layout 'nx'"), ("bf16:8x8", "MxNxK"),
    ("bf16:8x0x8", "positive"), ("bf16", "dtype:MxNxK"), ("bf16:8x8x8:nn:x:y", "dtype:MxNxK"),
    (",", "no problem"),
    # fp8: its one layout, torch._scaled_mm's multiples of 16, a known scaling, and no scaling for other dtypes
    ("e4m3:16x32x64:nn", "layout nt"), ("fp8:16x32x64:tn:row", "not tn"),
    ("e4m3:16x24x64", "K and N multiples of 16"), ("e4m3:16x32x40:nt", "multiples of 16"),
    ("e4m3:16x32x64:nt:col", "unknown scaling 'col'; allowed: tensor, row"),
    ("bf16:8x8x8:nn:row", "a scaling ('row') is for e4m3 only"), ("e4m3:16x32x64:nt:row:x", "dtype:MxNxK")])
def test_bad_problems_say_what_is_allowed(text, says):
    with pytest.raises(bs.SpecError, match=re.escape(says)) as e:
        bs.parse_problems(text)
    assert text.strip(",") in str(e.value) or text == ","          # the message names the problem given


def test_fp8_problems_default_to_nt_and_tensor_scales():
    specs = bs.parse_problems("e4m3:16x12288x4096, fp8:64x4096x11008:nt:row,E4M3:32x48x64:NT:Row")
    assert specs == [bs.ProblemSpec("e4m3", 16, 12288, 4096, "nt", "tensor"),
                     bs.ProblemSpec("e4m3", 64, 4096, 11008, "nt", "row"),
                     bs.ProblemSpec("e4m3", 32, 48, 64, "nt", "row")]
    assert {s.op for s in specs} == {"scaled_mm"}
    assert specs[1].label() == "e4m3 64x4096x11008 nt row"
    assert bs.parse_problems("e4m3:16x32x64:nt:tensor,fp8:16x32x64") == [bs.ProblemSpec("e4m3", 16, 32, 64, "nt",
                                                                                         "tensor")]


def test_the_issue27_set():
    specs = bs.problem_set("issue27")
    bf16 = [s for s in specs if s.dtype == "bf16"]
    assert len(bf16) == 8 and {s.layout for s in bf16 if s.k == 4096 and s.n in (11008, 14336)} == {"nt"}
    assert bs.ProblemSpec("bf16", 12288, 12288, 128, "nn") in specs
    assert bs.ProblemSpec("bf16", 8192, 4096, 14336, "nt") in specs
    assert [s for s in specs if s.dtype == "int8"] == [bs.ProblemSpec("int8", 1024, 22016, 4096, "nt"),
                                                      bs.ProblemSpec("int8", 4096, 4096, 4096, "nt")]
    assert bs.problem_set("issue27-bf16") + bs.problem_set("issue27-int8") == specs
    with pytest.raises(bs.SpecError, match="unknown set 'nope'; sets: issue27"):
        bs.problem_set("nope")


def test_the_issue30_sets_are_bench_compares_fp8_suite_with_each_scaling():
    from bench.shapes import FP8_SUITES

    tensor, row = bs.problem_set("issue30-tensor"), bs.problem_set("issue30-row")
    assert [(s.m, s.n, s.k) for s in tensor] == [(s.m, s.n, s.k) for s in FP8_SUITES["fp8"]] == [
        (16, 12288, 4096), (64, 4096, 11008), (512, 12288, 4096), (4096, 4096, 4096), (8192, 8192, 8192),
        (8192, 14336, 4096)]
    assert {(s.dtype, s.layout, s.scaling, s.op) for s in tensor} == {("e4m3", "nt", "tensor", "scaled_mm")}
    assert {(s.dtype, s.layout, s.scaling) for s in row} == {("e4m3", "nt", "row")}
    assert bs.problem_set("issue30") == tensor + row and len(set(tensor + row)) == 12
    assert bs.resolve(["--set", "issue30-row"]).specs == row


def test_arguments_defaults_and_backends():
    args = bs.resolve([])
    assert args.specs == bs.problem_set("issue27")
    assert args.plan == bs.LoopPlan(seconds=1.5, rounds=2, heat=1.0, stat="median")
    args = bs.resolve(["--problems", "int8:4096x4096x4096:nt", "--seconds", "3", "--rounds", "3", "--stat", "min",
                       "--heat", "0", "--backends", "aten,triton,cutlass", "--time-limit", "500"])
    assert args.specs == [bs.ProblemSpec("int8", 4096, 4096, 4096, "nt")] and args.time_limit == 500
    assert args.plan == bs.LoopPlan(3.0, 3, 0.0, "min")
    assert config.backends == ("aten", "triton", "cutlass")        # the run's KERNELS_BACKENDS, through the config


@pytest.mark.parametrize("argv, says", [
    (["--set", "nope"], "unknown set 'nope'"), (["--problems", "fp4:8x8x8"], "unknown dtype"),
    (["--problems", "e4m3:16x16x16:nn"], "layout nt"), (["--problems", "e4m3:16x16x16:nt:rows"], "unknown scaling"),
    (["--problems", "bf16:8x8x8:xy"], "unknown layout"), (["--backends", "aten,bogus"], "unknown bogus"),
    (["--problems", "bf16:8x8x8", "--set", "smoke"], "not both"), (["--rounds", "1"], "at least 2 rounds"),
    (["--seconds", "0"], "positive"), (["--heat", "-1"], "non-negative"), (["--stat", "mean"], "invalid choice"),
    (["--time-limit", "x"], "not a number")])
def test_bad_input_is_a_usage_error(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bs.resolve(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU exit")
def test_without_cuda_a_clear_message_and_exit_2(capsys):
    assert bs.main(["--set", "smoke"]) == 2
    err = capsys.readouterr().err
    assert "CUDA GPU" in err and "Traceback" not in err


# -- the figures on fake loop results --------------------------------------------------------------------------------
def test_speedup_and_regret_use_one_statistic():
    kern, torch_ms = [1.0, 1.2, 0.9], [1.1, 1.1, 1.3]
    assert bs.STATS == br.STATS
    assert br.speedup(kern, torch_ms, "median") == pytest.approx(1.1 / 1.0)
    assert br.speedup(kern, torch_ms, "min") == pytest.approx(1.1 / 0.9)
    loops = {"win": [1.02, 1.04], "aten_mm": [1.0, 1.0], "other": [1.2, 1.1]}
    assert br.regret(loops, "win", "median") == (pytest.approx(0.03), "aten_mm")
    assert br.regret(loops, "aten_mm", "median") == (0.0, "aten_mm")
    assert br.regret({"win": [1.0, 1.0]}, "win", "median") == (None, None)      # nothing beside the winner
    assert br.regret({"a": [1.0], "b": [2.0]}, "win", "median") == (None, None)    # the winner could not be looped


def test_rank_agreement_on_pairs_the_loops_separate():
    loops = {"a": 1.00, "b": 1.02, "c": 1.10, "d": 1.30}
    # a-b are 2% apart: not compared; a<c, a<d, b<c, b<d, c<d are
    agree = br.rank_agreement(loops, {"a": 0.5, "b": 0.49, "c": 0.55, "d": 0.6}, "final_ms")
    assert (agree.pairs, agree.agreeing, agree.disagreements, agree.verdict) == (5, 5, [], "yes (5)")
    flipped = br.rank_agreement(loops, {"a": 0.5, "b": 0.5, "c": 0.45, "d": 0.6}, "final_ms")   # c looked fastest
    assert flipped.pairs == 5 and flipped.agreeing == 3 and flipped.verdict == "no (3/5)"
    assert sorted(flipped.disagreements) == [("a", "c"), ("b", "c")]
    assert br.rank_agreement({"a": 1.0, "b": 1.01}, {"a": 1.0, "b": 2.0}, "final_ms").verdict == "n/a"
    # a finalist the tuner has no time for is left out, not counted as a disagreement
    assert br.rank_agreement({"a": 1.0, "z": 2.0}, {"a": 1.0}, "timings").pairs == 0


def test_geomean():
    assert br.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert br.geomean([1.05]) == pytest.approx(1.05)


def _selection(details: dict, timings: dict, winner: str) -> Selection:
    choices = {name: Choice("aten" if name == "aten_mm" else "triton", name, "bf16") for name in timings}
    return Selection(problem=problem(), winner=winner, choices=choices, timings=timings, details=details)


def test_finalists_from_the_final_round_and_the_fastest_timed():
    timings = {"aten_mm": 0.20, "t1": 0.19, "t2": 0.21, "t3": 0.25, "t4": 0.30, "t5": 0.18, "t6": "failed: x"}
    details = {"aten_mm": {"final_ms": 0.205}, "t1": {"final_ms": 0.201}, "t5": {"p20_ms": 0.17}}
    names, tuner, source = br.finalists(_selection(details, timings, "t1"))
    # the final round's two (a duel), then the fastest others up to LOOPED_FINALISTS, without tuner times
    assert (names, tuner, source) == (["t1", "aten_mm", "t5", "t2"], {"t1": 0.201, "aten_mm": 0.205}, "final_ms")
    retimed = {"aten_mm": {"retimed_ms": 0.2}, "t5": {"retimed_ms": 0.21}, "t1": {"p20_ms": 0.18}}
    assert br.finalists(_selection(retimed, timings, "aten_mm")) == (
        ["aten_mm", "t5", "t1", "t2"], {"aten_mm": 0.2, "t5": 0.21}, "retimed_ms")     # main's burst final round
    names, tuner, source = br.finalists(_selection({}, timings, "t1"))
    assert source == "timings" and names == ["t5", "t1", "aten_mm", "t2"] and tuner["t5"] == 0.18
    # the winner is always looped, even when it is not among them
    names, _, _ = br.finalists(_selection({}, timings, "t4"))
    assert names[0] == "t4" and len(names) == 5


def test_alternate_runs_variants_in_turn_and_reads_after_the_last_loop():
    events = []

    def runner(call, n_sets, seconds):
        name = call(0)
        events.append(("loop", name, n_sets, seconds))

        def read():
            events.append(("read", name))
            return {"kernels": 1.0, "torch": 2.0}[name]
        return read

    out = bs.alternate({"kernels": lambda i: "kernels", "torch": lambda i: "torch"}, n_sets=3, rounds=3, seconds=1.5,
                       runner=runner)
    assert out == {"kernels": [1.0] * 3, "torch": [2.0] * 3}
    assert events[:6] == [("loop", n, 3, 1.5) for n in ["kernels", "torch"] * 3]      # A B A B A B
    assert [e[0] for e in events[6:]] == ["read"] * 6          # no read (a device sync) between loops


# -- the record and the table ----------------------------------------------------------------------------------------
def _result(label, dtype, kern, torch_ms, finalists=None, tuner=None, source="final_ms", **kw):
    return br.ProblemResult(label, dtype, "ok", winner=kw.pop("winner", "triton_tma_128x256x64_s3_w8"),
                            regime=kw.pop("regime", "steady"), tuned=kw.pop("tuned", True),
                            first_call_s=kw.pop("first_call_s", 2.41), tune_s=2.3, seconds=1.5,
                            kernels_rounds_ms=kern, torch_rounds_ms=torch_ms, finalist_source=source,
                            tuner_ms=tuner or {}, finalist_rounds_ms=finalists or {}, **kw)


def fake_run() -> list[br.ProblemResult]:
    win = "triton_tma_128x256x64_s3_w8"
    return [
        _result("bf16 4096x4096x4096 nn", "bf16", [0.190, 0.192], [0.200, 0.198],
                {win: [0.191, 0.190], "aten_mm": [0.199, 0.200], "cutlass3x_256x128x64": [0.188, 0.189]},
                {win: 0.186, "aten_mm": 0.196, "cutlass3x_256x128x64": 0.187}),
        _result("bf16 4096x11008x4096 nt", "bf16", [0.505, 0.507], [0.500, 0.502], winner="aten_mm",
                regime="burst", tuned=False, first_call_s=0.05,
                finalists={"aten_mm": [0.50, 0.50], "triton_mm_128x128x64": [0.56, 0.55]},
                tuner={"aten_mm": 0.49, "triton_mm_128x128x64": 0.45}, source="timings"),
        _result("int8 4096x4096x4096 nt", "int8", [0.100, 0.101], [0.190, 0.192], winner="cutlass3x_int8",
                regime=None),
        br.ProblemResult("bf16 8192x8192x8192 nn", "bf16", "error", message="RuntimeError: out of memory"),
        br.ProblemResult("bf16 6144x6144x6144 nn", "bf16", "skipped", message="--time-limit 500 s reached"),
    ]


def test_rows_say_what_was_measured():
    rows = {r.problem: dict(zip(br.HEADERS, br.table_row(r))) for r in fake_run()}
    first = rows["bf16 4096x4096x4096 nn"]
    assert first == {"problem": "bf16 4096x4096x4096 nn", "winner": "triton_tma_128x256x64_s3_w8", "regime": "steady",
                     "tune s": "2.41", "kernels ms": "0.1910", "torch ms": "0.1990", "speedup": "1.042x",
                     "regret": "1.1% (3)", "regime agrees": "yes (1)"}    # aten-cutlass: the one pair 5% apart
    nt = rows["bf16 4096x11008x4096 nt"]
    assert nt["tune s"] == "0.05 (disk)" and nt["speedup"] == "0.990x" and nt["regret"] == "0.0% (2)"
    assert nt["regime agrees"] == "no (0/1) burst"                # first-pass times ranked the slower one first
    assert rows["int8 4096x4096x4096 nt"]["regime"] == "-" and rows["int8 4096x4096x4096 nt"]["regret"] == "-"
    assert rows["bf16 8192x8192x8192 nn"]["winner"] == "error: RuntimeError: out of memory"
    assert rows["bf16 6144x6144x6144 nn"]["winner"].startswith("skipped: --time-limit")


def test_geomean_per_dtype_over_measured_problems():
    rows = {r[0]: r for r in br.geomean_rows(fake_run())}
    assert rows["bf16"] == ["bf16", f"{br.geomean([0.199 / 0.191, 0.501 / 0.506]):.3f}x", "0.990x", "2"]
    assert rows["int8"] == ["int8", "1.900x", "1.900x", "1"]


def test_plain_and_rich_tables(capsys):
    results = fake_run()
    text = br.plain_table(results, "TITLE")
    lines = text.splitlines()
    assert lines[0] == "TITLE" and lines[1].split() == ["problem", "winner", "regime", "tune", "s", "kernels", "ms",
                                                         "torch", "ms", "speedup", "regret", "regime", "agrees"]
    assert any(line.startswith("bf16 4096x4096x4096 nn") and "1.042x" in line for line in lines)
    assert "dtype  geomean speedup  lowest  problems" in text
    br.print_table(results, "TITLE")
    out = capsys.readouterr().out
    assert "TITLE" in out and "1.042x" in out and "1.900x" in out and "error: RuntimeError" in out


def test_json_lines_round_trip_and_table_from(tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    header = {"kind": "run", "gpu": "NVIDIA H100", "backends": "aten,triton,padded", "seconds": 1.5, "rounds": 2,
              "stat": "median"}
    records = [r.to_json() for r in fake_run()]
    path.write_text("\n".join(json.dumps(x) for x in [header] + records) + "\n")
    first = records[0]
    assert first["speedup"] == pytest.approx(0.199 / 0.191) and first["best_finalist"] == "cutlass3x_256x128x64"
    assert first["regime_check"]["pairs"] == 1 and first["kernels_rounds_ms"] == [0.190, 0.192]
    run, results = br.read_run(str(path))
    assert run == header and [br.table_row(r) for r in results] == [br.table_row(r) for r in fake_run()]
    assert bs.main(["--table-from", str(path)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100" in out and "backends aten,triton,padded" in out and "1.042x" in out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "problem", "problem": "x"}\n')
    assert bs.main(["--table-from", str(bad)]) == 2
    assert "line 1 is not a bench.sustained record" in capsys.readouterr().err
    assert bs.main(["--table-from", str(tmp_path / "absent.jsonl")]) == 2


def test_fp8_rows_geomean_per_scaling_and_every_speedup_recomputes_from_the_printed_times():
    results = [_result("e4m3 16x12288x4096 nt tensor", "e4m3", [0.020498, 0.020502], [0.021549, 0.021551],
                       scaling="tensor"),
               _result("e4m3 16x12288x4096 nt row", "e4m3", [0.02210, 0.02212], [0.02301, 0.02303], scaling="row"),
               _result("e4m3 4096x4096x4096 nt row", "e4m3", [0.2505, 0.2507], [0.2601, 0.2600], scaling="row")]
    rows = [dict(zip(br.HEADERS, br.table_row(r))) for r in results]
    assert rows[0]["kernels ms"] == "0.02050" and rows[0]["torch ms"] == "0.02155"     # 4 significant digits
    for row in rows:
        assert row["speedup"] == f"{float(row['torch ms']) / float(row['kernels ms']):.3f}x"
    groups = {r[0]: r for r in br.geomean_rows(results)}
    assert set(groups) == {"e4m3 tensor", "e4m3 row"} and groups["e4m3 row"][3] == "2"
    assert br.ProblemResult.from_json(results[1].to_json()).scaling == "row"


def test_finish_duels_calls_until_the_problems_duel_is_decided_and_says_when_it_gave_up():
    from bench.measure import finish_duels

    left = [45]

    def call():
        left[0] -= 1
        return left[0]

    run = finish_duels(call, "cpu", every=20, pending=lambda: left[0] > 0)
    assert (run.calls, run.timed_out, run.last) == (60, False, -15) and run.seconds is not None
    assert finish_duels(call, "cpu", pending=lambda: False).seconds is None       # nothing pending: no call
    stuck = finish_duels(lambda: None, "cpu", limit_s=0.05, pending=lambda: True)
    assert stuck.timed_out and stuck.calls >= 1
