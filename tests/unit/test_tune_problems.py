"""Problem lists for `python -m kernels tune` (kernels.tune.problem_list): CSV, JSON and recorded JSONL traces into
GemmProblems, bad input named by file, line and column; and the offline run's order of work (kernels.tune.offline)
with the lookups handed in, so no tune runs here."""
import dataclasses
import io
import json
import shutil

import pytest
import torch

from backends import get_backend
from backends.cutlass import CutlassBackend
from kernels.__main__ import main
from kernels.core.config import config
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection
from kernels.dispatch.record import trace_line
from kernels.dispatch.dynamic_records import Dynamic
from kernels.core.toolchain import resolve
from kernels.tune import offline
from kernels.tune.autotune import candidates
from kernels.tune.problem_list import DynamicSpec, ProblemListError, ProblemListWarning, read, read_all, retarget
from tests.helpers import problem


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_csv_rows_become_problems_as_freshly_allocated_operands(tmp_path):
    path = write(tmp_path, "p.csv", "M,N,K,dtype,layout,bias,activation\n"
                                    "# a comment, then a blank line\n\n"
                                    "64,48,32,fp16,nt,1,gelu\n"
                                    "16,8,128,int8,tn,,\n"
                                    " 32 , 32 , 32 , FP32 , NN , no , none \n")
    first, second, third = read(path)
    assert first.where == f"{path}:4" and first.dynamic is None
    p = first.problem
    assert (p.op, p.m, p.n, p.k, p.dtype, p.out_dtype) == ("mm", 64, 48, 32, "fp16", "fp16")
    assert (p.stride_a, p.stride_b, p.layout_a, p.layout_b) == ((32, 1), (1, 32), "row", "col")
    assert (p.bias, p.activation, p.epilogue, p.align_a, p.align_b) == (True, "gelu", "bias+gelu", 16, 16)
    q = second.problem
    assert (q.op, q.out_dtype, q.stride_a, q.stride_b, q.epilogue) == ("int_mm", "int32", (1, 16), (8, 1), "")
    assert third.problem.precision == "ieee" and third.problem.epilogue == ""     # torch's default: highest


def test_json_list_with_line_numbers_and_any_key_case(tmp_path):
    path = write(tmp_path, "p.json", '[\n  {"op": "mm", "M": 64, "N": 48, "K": 32, "dtype": "bf16", "layout": "nt"},'
                                     '\n  {"m": "8", "n": 8, "k": 8, "dtype": "fp16", "layout": "tt",\n'
                                     '   "bias": true, "activation": "silu"}\n]\n')
    first, second = read(path)
    assert first.where == f"{path}:2" and second.where == f"{path}:3"
    assert first.problem.dtype == "bf16" and first.problem.layout_b == "col"
    assert second.problem.layout_a == "col" and second.problem.epilogue == "bias+silu"


def test_a_recorded_trace_round_trips_exactly(tmp_path):
    static = dataclasses.replace(problem(m=10, n=8, k=16, dtype="fp32", lb="col", align_a=4), bias=True,
                                 activation="relu")
    dyn = Dynamic("m", hints=(16, 256), mode="similarity", buckets="exact", pool=2).resolved()
    runtime = problem(m=300, n=64, k=128, dtype="fp16")
    path = write(tmp_path, "t.jsonl", trace_line(static) + "\n" + trace_line(runtime, dyn) +
                 '{"m": 4, "n": 4, "k": 4, "dtype": "fp16", "layout": "nn"}\n')
    first, second, third = read(path)
    assert first.problem == static and first.dynamic is None and first.where == f"{path}:1"
    assert second.problem == dataclasses.replace(runtime, dynamic=("m",)) and second.where == f"{path}:3"
    assert second.dynamic == DynamicSpec(hints=(("m", (16, 256)),), mode="similarity", buckets="exact", pool=2)
    assert third.problem.m == 4                      # a short line in a trace is fine too


def test_fp8_rows_are_scaled_mm_problems_and_their_trace_round_trips(tmp_path):
    path = write(tmp_path, "p.csv", "m,n,k,dtype,layout,bias,scaling,out_dtype\n"
                                    "16,4096,4096,e4m3,nt,,,\n"
                                    "64,512,1024,e5m2,nt,1,row,fp16\n")
    first, second = read(path)
    p, q = first.problem, second.problem
    assert (p.op, p.dtype, p.scaling, p.out_dtype, p.bias, p.layout_a, p.layout_b) == (
        "scaled_mm", "e4m3", "tensor", "bf16", False, "row", "col")
    assert (q.op, q.dtype, q.scaling, q.out_dtype, q.bias) == ("scaled_mm", "e5m2", "row", "fp16", True)
    (again,) = read(write(tmp_path, "t.jsonl", trace_line(q) + "\n"))
    assert again.problem == q


def test_an_older_trace_line_without_the_epilogue_fields_still_reads(tmp_path):
    data = json.loads(trace_line(problem(m=8, n=8, k=8, dtype="fp16")))
    for key in ("bias", "activation", "dynamic", "precision"):
        del data[key]
    (only,) = read(write(tmp_path, "t.jsonl", json.dumps(data) + "\n"))
    assert only.problem == problem(m=8, n=8, k=8, dtype="fp16")


def test_duplicates_across_files_and_devices_are_one_problem(tmp_path):
    a = write(tmp_path, "a.csv", "m,n,k,dtype,layout\n8,8,8,fp16,nn\n8,8,8,fp16,nn\n")
    b = write(tmp_path, "b.jsonl", trace_line(problem(m=8, n=8, k=8, dtype="fp16", arch=80)) +
              trace_line(problem(m=8, n=8, k=8, dtype="fp16", arch=90)))
    listed = read_all([a, b])
    assert len(listed) == 3 and listed[0].where == f"{a}:2"      # csv's placeholder device, then two GPUs
    here = retarget(listed, "cuda", 90, "H100")
    assert len(here) == 1 and here[0].problem.device_name == "H100" and here[0].where == f"{a}:2"


@pytest.mark.parametrize("name, text, message", [
    ("p.csv", "m,n,k,dtype,layout,flavour\n", r"p.csv:1: column 6 \('flavour'\): not a known column"),
    ("p.csv", "m,n,k,dtype\n8,8,8,fp16\n", r"p.csv:1: the header lacks the column\(s\) layout"),
    ("p.csv", "m,n,k,dtype,layout,m\n", r"p.csv:1: column 6 \(m\): given twice"),
    ("p.csv", "m,n,k,dtype,layout\n8,8,8,fp16,nn\n8,x,8,fp16,nn\n", r"p.csv:3: column 2 \(n\): 'x' is not a positive"),
    ("p.csv", "m,n,k,dtype,layout\n8,8,0,fp16,nn\n", r"p.csv:2: column 3 \(k\): 0 is not a positive integer"),
    ("p.csv", "m,n,k,dtype,layout\n99999999999,8,8,fp16,nn\n",
     r"p.csv:2: column 1 \(m\): 99999999999 is not below 2147483648"),
    ("p.csv", "m,n,k,dtype,layout\n8,8,8,fp64,nn\n", r"p.csv:2: column 4 \(dtype\): 'fp64' is not one of"),
    ("p.csv", "m,n,k,dtype,layout\n8,8,8,fp16,nx\n", r"p.csv:2: column 5 \(layout\): 'nx' is not one of nn, nt"),
    ("p.csv", "m,n,k,dtype,layout\n8,8,8,fp16\n", r"p.csv:2: 4 fields, the header has 5"),
    ("p.csv", "m,n,k,dtype,layout,op\n8,8,8,fp16,nn,int_mm\n", r"p.csv:2: column 6 \(op\): int_mm takes int8"),
    ("p.csv", "m,n,k,dtype,layout,activation\n8,8,8,int8,nn,relu\n",
     r"p.csv:2: column 6 \(activation\): int_mm has no epilogue"),
    ("p.csv", "m,n,k,dtype,layout,bias\n8,8,8,fp16,nn,maybe\n", r"p.csv:2: column 6 \(bias\): 'maybe' is not a flag"),
    ("p.csv", "m,n,k,dtype,layout\n16,32,32,e4m3,nn\n", r"p.csv:2: column 5 \(layout\): 'nn': scaled_mm takes A row-major"),
    ("p.csv", "m,n,k,dtype,layout,scaling\n16,32,32,e4m3,nt,block\n",
     r"p.csv:2: column 6 \(scaling\): 'block' is not one of tensor, row"),
    ("p.csv", "m,n,k,dtype,layout,scaling\n16,32,32,bf16,nt,row\n",
     r"p.csv:2: column 6 \(scaling\): 'row': only scaled_mm \(fp8\) problems have a scaling, not mm"),
    ("p.csv", "m,n,k,dtype,layout,out_dtype\n16,32,32,e4m3,nt,e4m3\n",
     r"p.csv:2: column 6 \(out_dtype\): 'e4m3' is not one of bf16, fp16, fp32"),
    ("p.csv", "m,n,k,dtype,layout,activation\n16,32,32,e4m3,nt,relu\n",
     r"p.csv:2: column 6 \(activation\): scaled_mm has no activation"),
    ("p.json", '[\n{"m": 8, "n": 8, "k": 8, "dtype": "fp16", "layout": "nn", "colour": 1}]',
     r"p.json:2: key 'colour': not a known key"),
    ("p.json", '[{"m": 8, "n": 8,\n "k": 8, "dtype": "fp16", "layout": "nn",}]', r"p.json:2: column \d+: not valid JSON"),
    ("p.json", '{"m": 8}', r"p.json:1: expected a list of problems"),
    ("p.json", '[\n{"m": 8, "n": 8, "k": 8, "dtype": "fp16"}]', r"p.json:2: key 'layout': missing"),
    ("p.json", '[8]', r"p.json:1: expected an object, got int"),
    ("t.jsonl", '{"m": 8, "n": 8, "k": 8, "dtype": "fp16", "layout": "nn"}\n{"m": 8,\n',
     r"t.jsonl:2: column \d+: not valid JSON"),
])
def test_bad_lists_name_file_line_and_column(tmp_path, name, text, message):
    with pytest.raises(ProblemListError, match=message):
        read(write(tmp_path, name, text))


def test_a_trace_whose_recorder_stopped_mid_line_reads_up_to_that_line(tmp_path):
    """A recording process killed mid-write leaves a partial last line (no newline): it is left out with a warning,
    the lines before it stand."""
    line = trace_line(problem(m=8, n=8, k=8, dtype="fp16")).rstrip("\n")
    path = write(tmp_path, "t.jsonl", line + "\n" + line[: len(line) // 2])
    with pytest.warns(ProblemListWarning, match="t.jsonl:2: the trace ends in a partial line"):
        items = read(path)
    assert [i.problem.m for i in items] == [8]
    # a whole last line that fails (its closing brace there) is a mistake: an error, as on any other line
    path = write(tmp_path, "t.jsonl", line + "\n" + line[:-1] + ',}')
    with pytest.raises(ProblemListError, match=r"t.jsonl:2: column \d+: not valid JSON"):
        read(path)


def test_a_trace_append_cut_short_loses_only_its_own_line(tmp_path):
    """An append that stopped part way (a full disk: a short write) leaves a cut line in the middle once more lines
    follow: the next recorder starts on a line of its own (kernels.dispatch.record), and reading leaves the cut
    line out with a warning, every other line standing (an attacker's probe: one cut line refused the whole file)."""
    from kernels.dispatch import record as recorder

    first, second, third = (trace_line(problem(m=m, n=8, k=8, dtype="fp16")) for m in (8, 16, 24))
    path = tmp_path / "t.jsonl"
    path.write_text(first + second[: len(second) // 2])           # the second append stopped part way
    recorder._append(str(path), third)
    assert path.read_text().splitlines()[2] == third.rstrip("\n")
    with pytest.warns(ProblemListWarning, match="t.jsonl:2: a line cut short"):
        items = read(path)
    assert [i.problem.m for i in items] == [8, 24]
    recorder._append(str(path), first)                             # a whole last line: no extra newline
    assert path.read_text().endswith(third + first)
    # cut just after a nested object's brace (trace keys are sorted: dynamic_spec's sits mid-line): cut short too
    path.write_text('{"activation": "", "dynamic_spec": {"hints": [16]}' + "\n" + first)
    with pytest.warns(ProblemListWarning, match="t.jsonl:1: a line cut short"):
        assert [i.problem.m for i in read(path)] == [8]
    # a line with something wrong inside it is a mistake, wherever it is: "{...}," from a JSON array
    path.write_text(first.rstrip("\n") + ",\n" + third)
    with pytest.raises(ProblemListError, match=r"t.jsonl:1: column \d+: not valid JSON: Extra data"):
        read(path)


def test_an_op_linear_row_points_to_the_bias_and_activation_columns(tmp_path):
    with pytest.raises(ProblemListError, match=r"t.csv:2: column 6 \(op\): 'linear': kernels.linear's problems are mm "
                                               "rows"):
        read(write(tmp_path, "t.csv", "m,n,k,dtype,layout,op\n16,16,32,bf16,nt,linear\n"))


def test_a_scaled_mm_row_the_call_would_refuse_is_refused_in_the_list(tmp_path):
    """scaled_mm takes K and N multiples of 16 (torch._scaled_mm's rule): a list row that breaks it was tuned and
    stored, for a problem kernels.scaled_mm then refuses (a new user's probe)."""
    with pytest.raises(ProblemListError, match=r"t.csv:2: column 3 \(k\): scaled_mm takes K and N multiples of 16"):
        read(write(tmp_path, "t.csv", "m,n,k,dtype,layout\n16,16,8,e4m3,nt\n"))
    assert [i.problem.k for i in read(write(tmp_path, "t.csv", "m,n,k,dtype,layout\n16,16,32,e4m3,nt\n"))] == [32]
    good, = read(write(tmp_path, "t.csv", "m,n,k,dtype,layout\n16,16,32,e4m3,nt\n"))
    recorded = json.loads(trace_line(good.problem))
    with pytest.raises(ProblemListError, match=r"t.jsonl:1: key 'n': scaled_mm takes K and N multiples of 16"):
        read(write(tmp_path, "t.jsonl", json.dumps(dict(recorded, n=24)) + "\n"))    # a recorded (long-form) line


@pytest.mark.parametrize("name,text,message", [
    ("t.csv", "m,n,k,dtype,layout\n\u00b2,8,8,fp16,nn\n", r"t.csv:2: column 1 \(m\): '\u00b2' is not a positive"),
    ("t.csv", "m,n,k,dtype,layout\n" + "9" * 5000 + ",8,8,fp16,nn\n", r"t.csv:2: column 1 \(m\): '9+\.\.\. is not a"),
    ("t.json", '[{"m": ' + "9" * 5000 + ', "n": 8, "k": 8, "dtype": "fp16", "layout": "nn"}]',
     r"t.json: not a problem list: ValueError"),
    ("t.json", "[" * 100000 + "]" * 100000, r"t.json: not a problem list: RecursionError"),
    ("t.jsonl", "[" * 100000 + "]" * 100000 + "\n", r"t.jsonl:1: not a problem: RecursionError"),
    ("t.csv", "m,n,k,dtype,layout\n" + "x" * 200000 + ",8,8,fp16,nn\n", r"t.csv: not a problem table: field larger"),
])
def test_hostile_problem_lists_are_errors_naming_the_file(tmp_path, name, text, message):
    """Values and shapes a parser chokes on (a superscript digit that str.isdigit() takes, integers past int()'s
    4300 digits, nesting past the JSON parser's depth, a CSV field past the csv module's limit) are ProblemListErrors
    naming the file, not tracebacks (an attacker's probe)."""
    with pytest.raises(ProblemListError, match=message):
        read(write(tmp_path, name, text))


def _trace_with(tmp_path, **change) -> str:
    data = json.loads(trace_line(problem(m=8, n=8, k=8, dtype="fp16")))
    data.update(change)
    return str(write(tmp_path, "t.jsonl", "\n" + json.dumps({k: v for k, v in data.items() if v is not None})))


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, r"t.jsonl:2: key 'colour': not a field of a recorded problem"),
    ({"m": None}, r"t.jsonl:2: key 'm': missing"),
    ({"stride_a": [8]}, r"key 'stride_a': \[8\] is not a pair of integers"),
    ({"align_b": 3}, r"key 'align_b': 3 is not one of \(1, 2, 4, 8, 16\)"),
    ({"out_dtype": "fp32"}, r"key 'out_dtype': 'fp32': mm of fp16 gives fp16"),
    ({"precision": "tf32"}, r"key 'precision': 'tf32': only fp32 products have a precision"),
    ({"dynamic": ["q"]}, r"key 'dynamic': unknown dynamic dimension"),
    ({"dynamic": ["m"], "activation": "gelu"}, r"key 'dynamic': kernels.linear's and scaled_mm's problems are never dynamic"),
    ({"dynamic": ["m"], "dynamic_spec": {"hints": {"m": [0]}, "mode": "benchmark", "buckets": "pow2", "pool": 3}},
     r"t.jsonl:2: key 'dynamic_spec.hints': .* is not one list of positive sizes per dynamic dim \(m\)"),
    ({"dynamic": ["m"], "dynamic_spec": {"hints": {"m": [4]}, "mode": "fast", "buckets": "pow2", "pool": 3}},
     r"key 'dynamic_spec.mode': 'fast' is not one of benchmark, similarity"),
    ({"dynamic_spec": {}}, r"key 'dynamic_spec': given for a problem without dynamic dims"),
    ({"bias": "yes"}, r"key 'bias': 'yes' is not true or false"),
    ({"scaling": "row"}, r"key 'scaling': 'row': only scaled_mm problems have a scaling"),
    ({"op": "scaled_mm", "dtype": "e4m3", "out_dtype": "bf16", "scaling": "block"},
     r"key 'scaling': 'block' is not one of tensor, row"),
    ({"op": "scaled_mm", "dtype": "e4m3", "out_dtype": "e4m3", "scaling": "row"},
     r"key 'out_dtype': 'e4m3' is not one of bf16, fp16, fp32"),
])
def test_bad_trace_lines_name_the_line_and_key(tmp_path, change, message):
    with pytest.raises(ProblemListError, match=message):
        read(_trace_with(tmp_path, **change))


def test_missing_file_and_unknown_suffix(tmp_path):
    with pytest.raises(ProblemListError, match=r"nope.csv: no such file"):
        read(tmp_path / "nope.csv")
    with pytest.raises(ProblemListError, match=r"p.txt: not a problem list: expected a .csv, .json, .jsonl file"):
        read(write(tmp_path, "p.txt", "m,n,k\n"))


def test_cli_bad_input_exits_2_naming_the_place(tmp_path, capsys):
    path = write(tmp_path, "p.csv", "m,n,k,dtype,layout,flavour\n")
    assert main(["tune", str(path), "--dry-run"]) == 2
    assert f"{path}:1: column 6 ('flavour')" in capsys.readouterr().err
    assert main(["tune", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl: no such file" in capsys.readouterr().err
    assert main(["tune", str(write(tmp_path, "empty.jsonl", ""))]) == 2
    assert "no problems listed" in capsys.readouterr().err


def test_cli_dry_run_lists_and_tunes_nothing(tmp_path, capsys):
    path = write(tmp_path, "p.csv", "m,n,k,dtype,layout\n8,8,8,fp16,nn\n16,8,8,fp16,nt\n")
    config.duel = "calls"
    assert main(["tune", str(path), "--dry-run"]) == 0
    assert config.duel == "calls"      # the run's duels in the loop were for the run only (main() called in-process)
    out = capsys.readouterr().out
    assert "mm 8x8x8 fp16 nn" in out and "mm 16x8x8 fp16 nt" in out and f"{path}:3" in out
    assert "2 problems: 2 would be tuned, 0 in store (dry run: nothing tuned)" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="about a machine without a GPU")
def test_cli_without_gpu_or_interpreter_exits_2_unless_dry_run(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = write(tmp_path, "p.csv", "m,n,k,dtype,layout\n8,8,8,fp16,nn\n")
    assert main(["tune", str(path)]) == 2
    assert "no GPU here" in capsys.readouterr().err
    assert main(["tune", str(path), "--dry-run"]) == 0
    assert "would be tuned (no GPU here: the store was not checked)" in capsys.readouterr().out


# -- the run's order of work, with the lookups handed in -------------------------------------------------------------
def _selection(p: GemmProblem, winner: str = "triton_x", pending=()) -> Selection:
    return Selection(problem=p, winner=winner, choices={"aten_mm": Choice("aten", "aten_mm", p.dtype),
                                                         "triton_x": Choice("triton", "triton_x", p.dtype)},
                     timings={"aten_mm": 3.0, "triton_x": 2.0}, pending=list(pending))


def _listed(tmp_path, count: int):
    rows = "".join(f"{8 * (i + 1)},8,8,fp16,nn\n" for i in range(count))
    return retarget(read(write(tmp_path, "p.csv", "m,n,k,dtype,layout\n" + rows)), "cpu", 0, "cpu")


def test_run_skips_stored_tunes_the_rest_and_reports_failures(tmp_path):
    items = _listed(tmp_path, 4)
    store = {items[0].problem: _selection(items[0].problem),
             items[1].problem: _selection(items[1].problem, pending=["triton_x"])}   # stale: looked up again
    replayed = []

    def replay(item):
        replayed.append(item.problem.m)
        if item.problem.m == 32:
            raise RuntimeError("no candidate could run it")
        return _selection(item.problem), True

    report = offline.run(items, store.get, replay, log=io.StringIO())
    assert replayed == [16, 24, 32]
    assert [o.status for o in report.outcomes] == ["in store", "tuned", "tuned", "failed"]
    assert report.outcomes[3].reason == "RuntimeError: no candidate could run it"
    assert offline.speedup(report.outcomes[1].selection) == pytest.approx(1.5)
    table = offline.summary(report)
    assert "mm 16x8x8 fp16 nn" in table and "1.50x" in table and "failed: RuntimeError" in table
    assert "4 problems: 2 tuned, 1 in store, 1 failed, 0 left" in table


def test_a_time_limit_of_zero_starts_nothing_and_says_what_is_left(tmp_path):
    items = _listed(tmp_path, 3)
    store = {items[1].problem: _selection(items[1].problem)}
    report = offline.run(items, store.get, lambda item: pytest.fail("nothing may start"), time_limit=0)
    assert [o.status for o in report.outcomes] == ["left", "in store", "left"]
    table = offline.summary(report)
    assert "3 problems: 0 tuned, 1 in store, 0 failed, 2 left" in table
    assert "2 left (--time-limit 0 s reached): run the same command again" in table


TOOLS = resolve()


@pytest.mark.skipif(not TOOLS.usable or shutil.which("ninja") is None,
                    reason=f"nvcc/CUTLASS/ninja missing: {TOOLS.message or 'ninja not on PATH'}")
def test_the_cutlass_candidates_of_what_is_to_tune_compile_first_in_one_batch_of_jobs(tmp_path, monkeypatch):
    """ninja is faked (the real path is test_cutlass_compile): the batch is the tuner's own candidates of the static
    problems the store lacks, compiled with --jobs (config.max_jobs) parallel compiles."""
    batches = []

    def fake_compile(self, todo, max_jobs=None, on_progress=None):
        batches.append(({p.paths.binary for p in todo}, max_jobs))
        for p in todo:
            p.paths.binary.parent.mkdir(parents=True, exist_ok=True)
            p.paths.binary.write_bytes(b"not a real library")

    monkeypatch.setattr(CutlassBackend, "_compile", fake_compile)
    monkeypatch.setattr(get_backend("cutlass"), "max_configs", 2)
    config.backends, config.max_jobs = ("aten", "cutlass"), 3
    items = retarget(read(write(tmp_path, "p.csv", "m,n,k,dtype,layout\n4096,4096,4096,bf16,nn\n"
                                                   "64,4096,4096,bf16,nt\n")), "cuda", 90, "test")
    store = {items[0].problem: _selection(items[0].problem)}
    report = offline.run(items, store.get, lambda item: (_selection(item.problem), True), log=io.StringIO())
    backend = get_backend("cutlass")
    expected = {backend.artifact_paths(items[1].problem, c)[1].binary
                for c in candidates(backend, items[1].problem).kept}
    assert batches == [(expected, 3)] and report.compiled == len(expected) > 0
    assert [o.status for o in report.outcomes] == ["in store", "tuned"]
