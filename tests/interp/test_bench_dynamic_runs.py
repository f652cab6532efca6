"""bench.dynamic run through the interpreter on CPU: a failing M is an error row, and the command end to end."""
import json
import os
import subprocess
import sys

import pytest
import torch

from bench import dynamic as bd
from kernels.core.config import interpret_mode
from tests.helpers import REPO


@pytest.mark.skipif(not interpret_mode(), reason="runs the interpreter on CPU tensors")
def test_one_failing_m_is_an_error_row(monkeypatch):
    args = bd.resolve_args(["--out", "x.json", "--num-m", "3", "--no-table", "--backends", "triton"], has_cuda=False)
    import kernels

    kernels.config.backends = ("triton",)
    bench = bd.Bench(args)
    real = bench.sweep_row

    def flaky(k, n, m):
        if m == 1:
            raise RuntimeError("illegal memory access (simulated)")
        return real(k, n, m)

    monkeypatch.setattr(bench, "sweep_row", flaky)
    out = bench.shape(32, 24, deadline=float("inf"))
    rows = {r["m"]: r for r in out["sweep"]["rows"]}
    assert set(rows) == set(bd.log_uniform_sizes(1, 128, 3))
    assert rows[1]["error"].startswith("RuntimeError: illegal memory access")
    good = [r for m, r in rows.items() if m != 1]
    assert all(isinstance(r["static_ms"], float) and r["benchmark_compiles"] == 0 for r in good)
    assert out["sweep"]["summary"]["errors"] == 1 and out["sweep"]["summary"]["benchmark"]["n"] == 2
    assert set(out["hint_tunes"]) == {"16", "64"}
    # an exhausted time budget skips the remaining M instead of running past it
    skipped = bench.shape(32, 24, deadline=0.0)
    assert {r.get("skipped") for r in skipped["sweep"]["rows"]} == {"skipped: time limit"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU mode")
def test_no_gpu_end_to_end(tmp_path):
    env = dict(os.environ, KERNELS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)                # the command sets it itself
    res = subprocess.run([sys.executable, "-m", "bench.dynamic", "--out", str(tmp_path / "r.json"), "--num-m", "3",
                          "--backends", "triton", "--cache-dir", str(tmp_path / "cache")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "No CUDA GPU" in res.stderr and "Hint × runtime M" in res.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    shape = data["shapes"][0]
    assert (shape["k"], shape["n"]) == (32, 24) and set(shape["hint_tunes"]) == {"16", "64"}
    rows = shape["hint_table"]["rows"]
    assert set(rows) == {"hint M=16 (before)", "hint M=64 (before)", "multi-kernel benchmark (after)",
                         "multi-kernel similarity (after)", "static tuned at this M"}
    assert all(isinstance(rows[r][str(m)]["ms"], float) for r in rows for m in (16, 64))
    assert len(shape["sweep"]["rows"]) == 3 and shape["sweep"]["summary"]["measured"] == 3
    assert data["stats"]["compiles"] == 0
    assert "| benchmark | 3 |" in (tmp_path / "r.md").read_text()
