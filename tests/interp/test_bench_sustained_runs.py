"""bench.sustained's measurement of one problem through the interpreter on CPU, with a host-clock loop in place of
the CUDA-event one: the first call tunes, the variants and the finalists are looped through the launches the
dispatcher builds, and the record says so (its GPU numbers: the closing note of issue 27)."""
import time

import pytest

import kernels
from bench import sustained as bs
from bench import sustained_report as br
from bench.measure import problem_for
from bench.progress import RunProgress
from bench.shapes import Shape
from kernels.core.config import interpret_mode
from kernels.measure.verify import make_inputs


def host_loop(call, n_sets, seconds):
    """bench.sustained's LoopRunner on the host clock: ms per call over the whole loop."""
    start, count = time.perf_counter(), 0
    while count == 0 or time.perf_counter() - start < seconds:
        call(count % n_sets)
        count += 1
    ms = (time.perf_counter() - start) * 1e3 / count
    return lambda: ms


@pytest.mark.skipif(not interpret_mode(), reason="runs the interpreter on CPU tensors")
def test_one_problem_measured_end_to_end():
    kernels.config.backends = ("aten", "triton")
    spec = bs.ProblemSpec("fp16", 32, 24, 16, "nt")
    plan = bs.LoopPlan(seconds=0.02, rounds=2, heat=0.01, stat="median")
    result = bs.measure_problem(spec, plan, RunProgress(1, quiet=True), device="cpu", runner=host_loop)
    sel = kernels.explain(*make_inputs(problem_for(Shape(32, 24, 16), "fp16", "nt", "cpu"), "cpu"))
    assert result.status == "ok" and result.tuned and result.first_call_s > 0
    assert result.winner == sel.winner and result.tune_s == sel.tune_seconds
    assert len(result.kernels_rounds_ms) == len(result.torch_rounds_ms) == 2
    names, tuner, source = br.finalists(sel)
    assert result.tuner_ms == tuner and result.finalist_source == source
    assert set(result.finalist_rounds_ms) | set(result.finalist_failures) == set(names)
    assert result.winner in result.finalist_rounds_ms and not result.finalist_failures
    row = dict(zip(br.HEADERS, br.table_row(result)))
    assert row["winner"] == sel.winner and row["speedup"].endswith("x") and row["regret"].endswith(f"({len(names)})")

    again = bs.measure_problem(spec, plan, RunProgress(1, quiet=True), device="cpu", runner=host_loop)
    assert not again.tuned and again.winner == result.winner          # served from this process's selection


@pytest.mark.skipif(not interpret_mode(), reason="runs the interpreter on CPU tensors")
def test_an_fp8_problem_through_the_command(capsys):
    """`--problems e4m3:...:row` parsed, run (kernels.scaled_mm against torch._scaled_mm, then the finalists through
    the launches the dispatcher builds, scales passed), each record emitted, and the table printed."""
    args = bs.resolve(["--problems", "e4m3:32x48x64:nt:row", "--backends", "aten,triton", "--seconds", "0.02",
                       "--heat", "0.01"])
    kernels.config.only = ("_s3_w4_",)         # a few Triton candidates: the loops, not the search, are tested
    records = []
    header, results = bs.run(args, RunProgress(1, quiet=True), records.append, device="cpu", runner=host_loop)
    (result,) = results
    assert result.status == "ok", result.message
    assert result.problem == "e4m3 32x48x64 nt row" and (result.dtype, result.scaling) == ("e4m3", "row")
    assert result.tuned and len(result.kernels_rounds_ms) == len(result.torch_rounds_ms) == 2
    assert result.winner in result.finalist_rounds_ms and not result.finalist_failures
    assert "aten_scaled_mm" in result.finalist_rounds_ms       # torch._scaled_mm's launch, and a Triton one:
    assert any(name.startswith("triton") for name in result.finalist_rounds_ms)   # user_call passed the scales
    assert header["problems"] == ["e4m3 32x48x64 nt row"] and [r["kind"] for r in records] == ["run", "problem"]
    assert records[1]["scaling"] == "row" and records[1]["speedup"] > 0
    bs.print_table(results, br.table_title(header))
    out = capsys.readouterr().out
    assert "e4m3 32x48x64 nt row" in out and result.winner in out and "e4m3 row" in out    # its geomean group
