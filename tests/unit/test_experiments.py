"""The harnesses in experiments/ on CPU: exhaustive_reference's problem list parses and it refuses to run without a
GPU (the full exhaustive tune it makes is GPU work; bench/gpu_check.sh exhaustive runs it), the side-by-side it shares
with fast_preset times both launches, fast_preset's summary, host_bound_diag's refusal without a GPU (fast_preset's
side-by-side of two built kernels: tests/interp/test_fast_preset.py), and the candidates cluster_pingpong_sweep
offers."""
import argparse

import pytest
import torch

from experiments import exhaustive_reference as er
from kernels.core.choice import Choice


def test_problem_list_parses_and_rejects_bad_items():
    assert er.parse_problems("int8:4000x4000x320, bf16:96X22016x4096") == [
        ("int_mm", "int8", 4000, 4000, 320), ("mm", "bf16", 96, 22016, 4096)]
    for bad in ("int8:4000x4000", "fp64:8x8x8", "bf16:0x8x8", "8x8x8"):
        with pytest.raises(argparse.ArgumentTypeError):
            er.parse_problems(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit) as e:
        er.main(["--problems", "int8:64x64x64"])
    assert e.value.code == 2


def test_timed_together_times_both_launches_over_the_rotated_sets():
    """The side-by-side both fast_preset and exhaustive_reference judge by, on CPU."""
    from experiments.fast_preset import timed_together
    from kernels.core.problem import GemmProblem
    from kernels.measure.verify import make_inputs

    a = torch.randn(16, 32)
    b = torch.randn(32, 8)
    problem = GemmProblem.from_tensors("mm", a, b)
    seen = {"a": 0, "b": 0}

    def launch(name):
        def run(x, y, out):
            seen[name] += 1
            return x @ y
        return run

    fast_ms, other_ms = timed_together(problem, make_inputs(problem, "cpu", seed=1), launch("a"), launch("b"), 1.0)
    assert fast_ms > 0 and other_ms > 0
    assert seen["a"] > 0 and seen["a"] == seen["b"]


def test_fast_preset_summary_splits_new_shapes_by_whether_their_picks_were_built():
    from experiments.fast_preset import summarize

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
    from experiments.fast_preset import summarize

    rows = [{"problem": ["mm", "bf16", 24, 64, 64], "ratio": 1.2, "fast_benchmarks": 6, "dataset_candidates": 60,
             "same_run": {"ratio": 0.98, "gpu_ratio": 1.2}, "new_shape": {"seconds": 0.5, "compiles": 0}},
            {"problem": ["mm", "bf16", 4096, 64, 64], "ratio": 1.0, "fast_benchmarks": 6, "dataset_candidates": 60,
             "same_run": {"ratio": 1.05}, "new_shape": {"seconds": 0.5, "compiles": 0}}]
    b = summarize(rows)["bf16"]
    assert b["same_run_worst"] == 1.05 and b["gpu_time_problems"] == 1
    assert b["judged_worst"] == 1.2 and b["judged_geomean"] == pytest.approx((1.2 * 1.05) ** 0.5)


def test_host_bound_diag_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    from experiments.host_bound_diag import main

    with pytest.raises(SystemExit) as e:
        main(["--problems", "int8:64x64x65536"])
    assert e.value.code == 2


def test_a_selection_reads_each_candidates_first_pass_time():
    """Finalists carry their first-pass time in their details (their timing is the final round's), candidates timed
    but never verified in their details' median; failures drop."""
    from kernels.core.selection import Selection
    from kernels.tune.final_round import not_verified
    from tests.helpers import problem

    names = ("aten_mm", "cutlass_x_sw1", "cutlass_y_sw1", "cutlass_z_sw1")
    sel = Selection(problem(), "aten_mm", {n: Choice("aten", n, "bf16") for n in names},
                    timings={"aten_mm": 1.0, "cutlass_x_sw1": 0.9, "cutlass_y_sw1": "crashed: boom",
                             "cutlass_z_sw1": not_verified(1.3)},
                    details={"aten_mm": {"first_pass_ms": 1.1}, "cutlass_x_sw1": {},
                             "cutlass_z_sw1": {"median_ms": 1.3}})
    assert sel.first_pass() == {"aten_mm": 1.1, "cutlass_x_sw1": 0.9, "cutlass_z_sw1": 1.3}


def test_selection_stages_sets_the_first_pass_beside_the_duel():
    """experiments.selection_stages (issue 28's layer tune, stage by stage): the first pass's fastest challenger by
    its first-pass time (not its final one), its ratio to aten there and in the duel, and the gap since the last
    tune ended."""
    from experiments.selection_stages import summary
    from kernels.core.choice import Choice
    from kernels.core.selection import Selection
    from kernels.space.heuristics import GemmConfig
    from tests.helpers import problem

    aten = Choice("aten", "aten_mm", "bf16")
    tma = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 128, 64, 5, 4))
    wide = Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))
    sel = Selection(problem=problem(), winner=aten.name, choices={c.name: c for c in (aten, tma, wide)},
                    timings={aten.name: 0.50, tma.name: 0.56, wide.name: 0.48, "broken": "crashed"},
                    details={aten.name: {"first_pass_ms": 0.50, "final_ms": 0.50},
                             tma.name: {"first_pass_ms": 0.45, "final_ms": 0.56, "final_ratio": 1.12}},
                    tune_seconds=1.5, created=100.0, stage_seconds={"final_round": 0.6}, regime="steady")
    row = summary(sel, previous_end=98.0)
    assert (row["challenger"], row["challenger_first_ratio"], row["challenger_final_ratio"]) == (tma.name, 0.9, 1.12)
    assert row["first_window_stop"] is False
    assert row["baseline_first_ms"] == 0.5 and row["timed"] == 3 and row["candidates"] == 3
    assert row["gap_before_s"] == 0.5 and row["stages"] == {"final_round": 0.6}
    assert "gap_before_s" not in summary(sel, previous_end=None)


def test_cluster_pingpong_sweep_offers_each_config_once_with_its_cluster_and_swizzle():
    """The sweep's candidates for an int8 problem with B column-major on sm90: every config of its list, named so
    that the tag parses back to the same tile, cluster, schedule and swizzle."""
    import dataclasses

    from experiments.cluster_pingpong_sweep import CONFIGS, configs_for
    from kernels.core.problem import GemmProblem
    from kernels.space.heuristics_cutlass import CutlassConfig

    a = torch.zeros(256, 512, dtype=torch.int8)
    b = torch.zeros(1024, 512, dtype=torch.int8).t()
    problem = dataclasses.replace(GemmProblem.from_tensors("int_mm", a, b), device="cuda", arch=90)
    choices = configs_for(problem)
    assert len({c.name for c in choices}) == len(choices) == len(CONFIGS)
    parsed = [CutlassConfig.from_params(c.params) for c in choices]
    assert [(p.tile_m, p.tile_n, p.cluster_m, p.cluster_n, p.schedule, p.swizzle) for p in parsed] == CONFIGS
    assert all(p.tile_k == 128 for p in parsed)       # 128 bytes of K per stage for 8-bit operands
