"""First contact without a GPU: `python -m bench.compare` checks correctness only, prints no speedups, its summary
agrees with its table, and `--plot` without matplotlib fails before any work (the options' help and the progress
line: tests/unit/test_first_contact_cli.py)."""
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO

no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="exercises the no-GPU mode")


def _compare(code_or_args, tmp_path, timeout=120, hide=()):
    """bench.compare in a fresh interpreter (TRITON_INTERPRET left for it to set); `hide`: modules made unimportable
    (a sys.modules entry of None) before it starts."""
    env = dict(os.environ, KERNELS_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in hide) + \
        f"from bench.compare import main\nsys.exit(main({code_or_args!r}))\n"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One correctness-only run on the tiny suite with padded beside Triton (17x33x65 is unaligned: padded runs;
    64x64x64 is aligned: padded is unavailable), its table printed as plain text (rich hidden)."""
    tmp = tmp_path_factory.mktemp("cpu_run")
    out = tmp / "r.json"
    res = _compare(["--backends", "aten,triton,padded", "--json", str(out)], tmp, hide=("rich",))
    assert res.returncode == 0, res.stderr[-3000:]
    return res, json.loads(out.read_text())


@no_gpu_only
def test_says_no_gpu_first_and_runs_tiny_fp16_shapes(cpu_run):
    res, data = cpu_run
    assert res.stderr.startswith("No GPU: a correctness-only run") and "Triton interpreter" in res.stderr
    assert res.stdout.startswith("NO GPU: correctness only")
    assert data["mode"] == "cpu-interpreter" and data["args"]["shapes"] == "tiny" and data["args"]["dtype"] == "fp16"
    assert [(s["m"], s["n"], s["k"]) for s in data["shapes"]] == [(64, 64, 64), (17, 33, 65)]


@no_gpu_only
def test_correctness_only_prints_no_speedups(cpu_run):
    res, data = cpu_run
    for word in ("vs aten", "geomean", "x torch", "TFLOP/s", "% floor", "speedup vs", "median ms"):
        assert word not in res.stdout, word
    assert not re.search(r"\d\.\d+x\b", res.stdout)          # no ratio anywhere
    summary = data["summary"]
    assert summary["geomean_speedup"] == {} and summary["wins"] == {} and summary["best_overall_geomean"] is None
    assert summary["kernels_mm_geomean"] is None
    cells = [c for s in data["shapes"] for c in s["cells"].values()]
    assert all(c["speedup"] is None and c["tflops"] is None for c in cells)
    assert all(s["kernels_mm"]["speedup"] is None and s["kernels_mm"]["torch_ms"] is None for s in data["shapes"])


def _table_rows(stdout: str) -> list[list[str]]:
    """The plain table's body rows, split on runs of two or more spaces, the shape carried down."""
    lines = stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("shape "))
    rows, shape = [], ""
    for ln in lines[header + 2:]:
        if not ln.strip():
            break
        parts = re.split(r" {2,}", ln.strip()) if ln.startswith(" ") else re.split(r" {2,}", ln)
        if not ln.startswith(" "):
            shape, parts = parts[0], parts[1:]
        rows.append([shape] + parts)
    return rows


@no_gpu_only
def test_summary_agrees_with_the_table(cpu_run):
    res, data = cpu_run
    rows = _table_rows(res.stdout)
    # the table: per column, how many shapes say each outcome
    table = {}
    for shape, column, result, *_ in rows:
        outcome = "matches" if column == "kernels.mm" and "matches the reference" in result else result.split(":")[0]
        table.setdefault(column, Counter())[outcome] += 1
    assert table["aten"] == Counter({"verified": 2}) and table["triton"] == Counter({"verified": 2})
    assert table["padded"] == Counter({"verified": 1, "unavailable": 1})
    assert table["kernels.mm"] == Counter({"matches": 2})
    # the summary lines say the same counts
    summary_lines = res.stdout.split("correctness over 2 shapes")[1].splitlines()
    line = {ln.split()[0]: ln for ln in summary_lines if ln.strip()}
    assert "verified on 2" in line["aten"] and "verified on 2" in line["triton"]
    assert "verified on 1" in line["padded"] and "unavailable on 1" in line["padded"]
    assert "matches the reference on 2" in line["kernels.mm"] and "of 2 called" in line["kernels.mm"]
    # ... and so does the JSON's summary, computed from the same cells
    for column in ("aten", "triton", "padded"):
        statuses = Counter("ok" if c["status"] == "ok" else c["status"] for s in data["shapes"]
                           for name, c in s["cells"].items() if name == column)
        assert data["summary"]["outcomes"][column] == dict(statuses)
    # "verified / built" beside each verified cell is the JSON's count
    for shape, column, result, verified, _tune in (r for r in rows if r[2] == "verified" and r[1] != "kernels.mm"):
        cell = next(s for s in data["shapes"] if shape.startswith(f"{s['m']}x{s['n']}x{s['k']}"))["cells"][column]
        built = cell["candidates"] - cell["unsupported"]
        assert verified.startswith(f"{cell['candidates'] - cell['failed']} / {built}")


@no_gpu_only
def test_a_median_is_never_printed_outside_its_own_p20_p80(cpu_run):
    _, data = cpu_run
    spread = [c for s in data["shapes"] for c in s["cells"].values() if c["p20_ms"] is not None]
    assert spread                      # the run printed spreads: the rule below is checked, not skipped
    for c in spread:
        assert c["p20_ms"] <= c["median_ms"] <= c["p80_ms"], c


def test_plot_without_matplotlib_fails_before_any_work(tmp_path):
    res = _compare(["--plot", str(tmp_path / "p.png"), "--shapes", "tiny"], tmp_path, timeout=60,
                   hide=("matplotlib",))
    assert res.returncode == 2
    assert 'pip install "kernels[plot]"' in res.stderr and "pip install matplotlib" in res.stderr
    assert res.stdout == "" and "No GPU" not in res.stderr        # nothing ran: no banner, no table
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "cache").exists()


@no_gpu_only
def test_plot_after_installing_matplotlib_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    res = _compare(["--plot", str(tmp_path / "p.png"), "--shapes", str(_one_shape(tmp_path)), "--quiet"],
                   tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _one_shape(tmp_path) -> Path:
    path = tmp_path / "one.csv"
    path.write_text("M,N,K\n16,16,32\n")
    return path
