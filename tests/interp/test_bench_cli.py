"""bench.compare end to end without a GPU: a subprocess on the tiny suite (Triton under the interpreter), and the
fast preset's side-by-side timing."""
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
