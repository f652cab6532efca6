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
