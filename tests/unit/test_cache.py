"""Selection store: atomic, corruption-tolerant, shared by concurrent processes; a warm process does no work."""
import json
import textwrap

import pytest
import torch

import kernels
from kernels.store.selections import SelectionStore
from kernels.core.choice import Choice
from kernels.core.config import interpret_mode
from kernels.core.selection import Selection
from tests.helpers import REPO, problem, run_python

needs_interp = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")


def selection(winner="aten_mm"):
    return Selection(problem=problem(), winner=winner, choices={winner: Choice("aten", winner, "bf16")},
                     timings={winner: 0.5, "triton_mm_x": "compile failed: boom"}, created=1.0,
                     stage_seconds={"build": 0.25, "first_pass": 0.125})


def test_put_get_roundtrip_and_key_mismatch(tmp_path):
    store = SelectionStore(tmp_path)
    store.put("k1", selection())
    got = store.get("k1")
    assert got.winner == "aten_mm" and got.source == "disk" and got.timings["triton_mm_x"].startswith("compile")
    assert got.stage_seconds == {"build": 0.25, "first_pass": 0.125}
    assert store.get("k2") is None


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]", json.dumps({"key": "k1", "selection": {"schema": 99}}),
                                     json.dumps({"key": "k1", "selection": {"schema": 1, "winner": "x"}})])
def test_corrupt_entry_is_a_miss(tmp_path, content):
    store = SelectionStore(tmp_path)
    store.put("k1", selection())
    store._path("k1").write_text(content)
    with pytest.warns(UserWarning, match="ignoring"):
        assert store.get("k1") is None


def test_no_temp_files_left_behind(tmp_path):
    store = SelectionStore(tmp_path)
    for i in range(5):
        store.put(f"k{i}", selection())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


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
    import subprocess
    import sys
    import os

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


def test_config_reads_environment_lazily_and_validates(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten, triton")
    assert kernels.config.backends == ("aten", "triton")
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,bogus")
    with pytest.raises(ValueError, match="KERNELS_BACKENDS"):
        _ = kernels.config.backends
    kernels.config.backends = ("aten",)
    assert kernels.config.backends == ("aten",)
    monkeypatch.setenv("KERNELS_SEARCH_SPACE", "exhaustive")
    assert kernels.config.search_space == "exhaustive"
    assert torch.is_tensor(torch.zeros(1))
