"""bench.compare end to end without a GPU: a subprocess on the tiny suite (Triton under the interpreter)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import REPO

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU mode")


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, KERNELS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)       # the command must set it itself
    return subprocess.run([sys.executable, "-m", "bench.compare", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_no_gpu_tiny_end_to_end(tmp_path):
    shapes = tmp_path / "one.csv"
    shapes.write_text("M,N,K\n17,33,65\n")
    out = tmp_path / "r.json"
    res = _run(["--backends", "aten,triton,cutlass,inductor", "--shapes", str(shapes), "--dtype", "fp16",
                "--json", str(out), "--csv", str(tmp_path / "r.csv")], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "No CUDA GPU" in res.stderr and "NO GPU" in res.stdout
    assert "triton_mm_fp16_" in res.stdout and "aten_mm" in res.stdout
    data = json.loads(out.read_text())
    assert data["mode"] == "cpu-interpreter"
    cells = data["shapes"][0]["cells"]
    assert cells["triton"]["status"] == "ok" and cells["triton"]["best"].startswith("triton_mm_fp16_")
    assert cells["inductor"]["status"] == "unavailable"
    assert cells["cutlass"]["status"] in ("unavailable", "failed", "ok")   # whether or not the backend exists yet
    assert data["shapes"][0]["kernels_mm"]["status"] == "ok"
    assert (tmp_path / "r.csv").read_text().count("17,33,65") >= 4


def test_issue_command_on_tiny_suite(tmp_path):
    res = _run(["--backends", "aten,triton", "--shapes", "tiny", "--dtype", "fp16", "--only", "_s[23]_",
                "--no-kernels-mm", "--quiet"], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "64x64x64" in res.stdout and "17x33x65" in res.stdout and "geomean" in res.stdout


def test_bad_shapes_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3\n4,five,6\n")
    res = _run(["--shapes", str(bad)], tmp_path, timeout=120)
    assert res.returncode == 2 and "row 2: N='five'" in res.stderr


def test_fast_preset_times_its_winner_beside_the_dataset_best():
    """bench.fast_preset's same-run ratio: the tuned winner and the dataset's best, built now, timed together."""
    import torch

    from backends import get_backend
    from bench.fast_preset import _side_by_side
    from kernels.core.choice import Choice
    from kernels.space.heuristics import GemmConfig
    from kernels.core.problem import GemmProblem

    a, b = torch.randn(24, 40).half(), torch.randn(40, 16).half()
    p = GemmProblem.from_tensors("mm", a, b)
    (winner,) = get_backend("triton").build(p, [Choice("triton", "triton_mm", "fp16", GemmConfig(16, 16, 16, 1, 2))])
    side = _side_by_side(p, winner.runner, Choice("aten", "aten_mm", "fp16"))
    assert side["fast_ms"] > 0 and side["best_ms"] > 0 and side["ratio"] == side["fast_ms"] / side["best_ms"]
    assert _side_by_side(p, winner.runner, winner.choice)["ratio"] == 1.0
    unbuildable = Choice("triton", "triton_mm", "fp16", None)          # no config: the template cannot render
    assert "did not build" in _side_by_side(p, winner.runner, unbuildable)["error"]


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
