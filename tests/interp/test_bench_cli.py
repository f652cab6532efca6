"""bench.compare end to end without a GPU: a subprocess on the tiny suite (Triton under the interpreter)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from kernels.measure.steady import plan_for
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
    # the row measured together (the token plan without a GPU), the tune's numbers kept beside it
    assert data["shapes"][0]["steady"]["reference"] == "aten_mm" and data["shapes"][0]["steady"]["failures"] == {}
    assert cells["triton"]["measured"] == "steady" and len(cells["triton"]["windows_ms"]) == plan_for("cpu").rounds
    assert cells["triton"]["tune_timing"]["median_ms"] > 0 and cells["triton"]["speedup"] is None
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


def test_fp8_compares_kernels_scaled_mm_on_tiny_fp8_shapes(tmp_path):
    """--dtype fp8 alone: the tiny fp8 suite in the nt layout with per-tensor scales; every column of the other
    dtypes, padded and Inductor unavailable with their reasons, kernels.scaled_mm's line, the row measured together."""
    out = tmp_path / "r.json"
    res = _run(["--dtype", "fp8", "--backends", "aten,triton,padded,inductor", "--only", "_s[34]_w4_",
                "--json", str(out), "--csv", str(tmp_path / "r.csv")], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "64x64x64 fp8 nt tensor" in res.stdout and "17x32x48 fp8 nt tensor" in res.stdout
    assert "kernels.scaled_mm" in res.stdout and "kernels.mm" not in res.stdout
    data = json.loads(out.read_text())
    assert (data["args"]["shapes"], data["args"]["layout"], data["args"]["scaling"]) == ("tiny-fp8", "nt", "tensor")
    for shape in data["shapes"]:
        cells = shape["cells"]
        assert (shape["op"], shape["dtype"], shape["scaling"]) == ("scaled_mm", "fp8", "tensor")
        assert cells["aten"]["status"] == "ok" and cells["aten"]["best"] == "aten_scaled_mm"
        assert cells["triton"]["status"] == "ok" and "_scaled_mm_e4m3_" in cells["triton"]["best"]
        assert cells["triton"]["failed"] == 0 and cells["triton"]["measured"] == "steady"
        assert cells["padded"] == {**cells["padded"], "status": "unavailable",
                                   "message": "no padded template for scaled_mm"}
        assert cells["inductor"]["status"] == "unavailable" and "CUDA GPU" in cells["inductor"]["message"]
        assert shape["kernels_mm"]["status"] == "ok" and shape["kernels_mm"]["measured"] == "steady"
        assert shape["steady"]["reference"] == "aten_scaled_mm" and shape["steady"]["failures"] == {}
    assert (tmp_path / "r.csv").read_text().count(",scaled_mm,fp8,nt,tensor,") == 2 * 5


def test_fp8_row_scales_and_a_layout_fp8_cannot_take(tmp_path):
    shapes = tmp_path / "one.csv"
    shapes.write_text("M,N,K\n16,32,64\n")
    res = _run(["--dtype", "fp8", "--scaling", "row", "--shapes", str(shapes), "--only", "_s3_w4_", "--quiet"],
               tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "16x32x64 fp8 nt row" in res.stdout and "matches the reference" in res.stdout
    bad = _run(["--dtype", "fp8", "--layout", "tn"], tmp_path, timeout=120)
    assert bad.returncode == 2 and "--layout tn: fp8 takes A row-major and B column-major only" in bad.stderr
    assert "No GPU" not in bad.stderr                                  # refused before the run starts
