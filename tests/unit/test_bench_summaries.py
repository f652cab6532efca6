"""What bench prints, from results given (no tuning): the fast preset's summary, a selection's table with its
rounds, and a GPU-only tool refusing without a GPU."""
import pytest
import torch


def test_fast_preset_summary_splits_new_shapes_by_whether_their_picks_were_built():
    from bench.fast_preset import summarize

    def row(dtype, ratio, same, seconds, compiles):
        return {"problem": ["mm", dtype, 64, 64, 64], "ratio": ratio, "same_run": {"ratio": same},
                "fast_benchmarks": 6, "dataset_candidates": 60,
                "new_shape": {"seconds": seconds, "compiles": compiles}}

    rows = [row("bf16", 0.9, 1.0, 0.5, 0), row("bf16", 1.1, 1.02, 0.7, 0), row("bf16", 1.0, 0.95, 2.0, 3),
            {"problem": ["int_mm", "int8", 8, 8, 8], "error": "no candidate"}]
    s = summarize(rows)
    assert list(s) == ["bf16"]
    b = s["bf16"]
    assert b["problems"] == 3 and b["worst"] == 1.1 and b["same_run_worst"] == 1.02
    assert b["geomean"] == pytest.approx((0.9 * 1.1 * 1.0) ** (1 / 3))
    assert (b["new_shape_warm"], b["new_shape_warm_max_s"], b["new_shape_compiled"], b["new_shape_compiled_max_s"]) \
        == (2, 0.7, 1, 2.0)
    assert b["timed_dataset"] / b["timed_fast"] == 10
    assert b["gpu_time_problems"] == 0 and b["judged_worst"] == 1.02


def test_fast_preset_summary_judges_short_calls_by_gpu_time():
    """Where the side-by-side has GPU times (calls under 0.1 ms) they judge the pick; elsewhere the call times do."""
    from bench.fast_preset import summarize

    rows = [{"problem": ["mm", "bf16", 24, 64, 64], "ratio": 1.2, "fast_benchmarks": 6, "dataset_candidates": 60,
             "same_run": {"ratio": 0.98, "gpu_ratio": 1.2}, "new_shape": {"seconds": 0.5, "compiles": 0}},
            {"problem": ["mm", "bf16", 4096, 64, 64], "ratio": 1.0, "fast_benchmarks": 6, "dataset_candidates": 60,
             "same_run": {"ratio": 1.05}, "new_shape": {"seconds": 0.5, "compiles": 0}}]
    b = summarize(rows)["bf16"]
    assert b["same_run_worst"] == 1.05 and b["gpu_time_problems"] == 1
    assert b["judged_worst"] == 1.2 and b["judged_geomean"] == pytest.approx((1.2 * 1.05) ** 0.5)


def test_selection_table_with_rounds_lists_every_timed_choice_fastest_first_with_its_round_times():
    from kernels.core.choice import Choice
    from kernels.core.problem import GemmProblem
    from kernels.core.selection import Selection

    problem = GemmProblem.from_tensors("mm", torch.empty(64, 64), torch.empty(64, 64))
    sel = Selection(problem, "fast", {n: Choice("aten", n, "fp32") for n in ("fast", "slow", "broken")},
                    timings={"slow": 0.0165, "fast": 0.0119, "broken": "failed verification: max error 3.0"},
                    details={"fast": {"first_pass_ms": 0.0145, "retimed_ms": 0.0119, "gpu_ms": 0.0106}, "slow": {}},
                    notes=["triton: benchmarking 5 of 1179 candidates"])
    lines = sel.table(rounds=True).splitlines()[1:]
    assert lines[0].split()[:3] == ["*", "fast", "11.90"]
    assert "first_pass_ms 14.50" in lines[0] and "gpu_ms 10.60" in lines[0]
    assert lines[1].split()[:2] == ["slow", "16.50"] and "first_pass_ms" not in lines[1]
    assert lines[2].split()[:2] == ["broken", "failed"] and lines[2].endswith("max error 3.0")
    assert lines[3] == "   note: triton: benchmarking 5 of 1179 candidates"
    assert "first_pass_ms" not in sel.table()                  # the default table is as it was


def test_host_bound_diag_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    from bench.host_bound_diag import main

    with pytest.raises(SystemExit) as e:
        main(["--problems", "int8:64x64x65536"])
    assert e.value.code == 2
