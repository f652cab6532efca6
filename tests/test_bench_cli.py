"""bench.compare end to end without a GPU: a subprocess on the tiny suite (Triton under the interpreter)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU mode")


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, KERNELS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)       # the command must set it itself
    return subprocess.run([sys.executable, "-m", "bench.compare", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_no_gpu_tiny_end_to_end(tmp_path):
    shapes = tmp_path / "one.csv"
    shapes.write_text("M,N,K\n17,33,65\n")
    out = tmp_path / "r.json"
    res = _run(["--backends", "aten,triton,cutlass,inductor", "--shapes", str(shapes), "--dtype", "fp16",
                "--json", str(out), "--csv", str(tmp_path / "r.csv")], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stderr.startswith("No GPU: a correctness-only run") and "NO GPU" in res.stdout
    assert "CUTLASS: compile-only" in res.stderr          # asked for, so built for sm90 (not run)
    triton_row = next(ln for ln in res.stdout.splitlines() if " triton " in ln)
    assert "verified" in triton_row and "unsupported" in triton_row     # e.g. "26 / 26, 2 unsupported"
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
    assert "64x64x64" in res.stdout and "17x33x65" in res.stdout and "correctness over 2 shapes" in res.stdout
    assert "geomean" not in res.stdout and "vs aten" not in res.stdout      # correctness only: no speedups
    assert res.stderr.startswith("No GPU") and "[" not in res.stderr           # --quiet: the banner, no notes


def test_bad_shapes_file_is_a_usage_error(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3\n4,five,6\n")
    res = _run(["--shapes", str(bad)], tmp_path, timeout=120)
    assert res.returncode == 2 and "row 2: N='five'" in res.stderr


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
