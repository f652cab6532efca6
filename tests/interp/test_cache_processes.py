"""The selection store across processes, through the interpreter: a warm process does no work, two processes
tuning at once tune once, a torn store file is retuned; CPU tensors without the interpreter go to torch."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from kernels.core.config import interpret_mode
from tests.helpers import REPO, run_python


needs_interp = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")


TUNE_AND_REPORT = textwrap.dedent("""
    import json, torch, kernels
    torch.manual_seed(0)
    a = torch.randn(24, 40).half(); b = torch.randn(40, 16).half()
    c = kernels.mm(a, b)
    ok = bool(((c.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm()) < 1e-2)
    print(json.dumps({"stats": kernels.stats(), "ok": ok, "source": kernels.explain(a, b).source}))
""")


def _report(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_interp
def test_warm_new_process_does_not_tune(isolated_cache):
    env = {"KERNELS_CACHE_DIR": str(isolated_cache), "TRITON_INTERPRET": "1"}
    first = _report(run_python(TUNE_AND_REPORT, env))
    assert first["ok"] and first["stats"]["tunes"] == 1 and first["stats"]["benchmarks"] > 1
    second = _report(run_python(TUNE_AND_REPORT, env))
    assert second["ok"]
    assert second["stats"]["tunes"] == 0 and second["stats"]["benchmarks"] == 0 and second["stats"]["compiles"] == 0
    assert second["stats"]["disk_hits"] == 1


@needs_interp
def test_two_processes_tuning_at_once_tune_once(isolated_cache):
    env = dict(os.environ, KERNELS_CACHE_DIR=str(isolated_cache), TRITON_INTERPRET="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-c", TUNE_AND_REPORT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, cwd=str(REPO)) for _ in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] for r in reports)
    assert sorted(r["stats"]["tunes"] for r in reports) == [0, 1]     # the second waited, then read the first's
    files = list((isolated_cache / "selections").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["selection"]["winner"]


@needs_interp
def test_corrupted_store_file_is_retuned(isolated_cache):
    env = {"KERNELS_CACHE_DIR": str(isolated_cache), "TRITON_INTERPRET": "1"}
    _report(run_python(TUNE_AND_REPORT, env))
    for f in (isolated_cache / "selections").glob("*.json"):
        f.write_text(f.read_text()[: len(f.read_text()) // 2])      # a run killed mid-write on a non-atomic store
    again = _report(run_python(TUNE_AND_REPORT, env))
    assert again["ok"] and again["stats"]["tunes"] == 1


def test_cpu_tensors_without_interpreter_use_torch(isolated_cache):
    code = textwrap.dedent("""
        import json, torch, kernels
        a = torch.randn(5, 7); b = torch.randn(7, 3)
        c = kernels.mm(a, b)
        s = kernels.explain(a, b)
        print(json.dumps({"ok": bool(torch.allclose(c, a @ b)), "source": s.source, "note": s.notes[0],
                          "stats": kernels.stats()}))
    """)
    rep = _report(run_python(code, {"KERNELS_CACHE_DIR": str(isolated_cache), "TRITON_INTERPRET": None}))
    assert rep["ok"] and rep["source"] == "cpu-fallback" and "torch.mm" in rep["note"]
    assert rep["stats"]["tunes"] == 0 and rep["stats"]["cpu_fallbacks"] == 1
