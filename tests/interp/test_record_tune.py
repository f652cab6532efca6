"""The problem trace and the offline tune end to end, through the interpreter: a process with KERNELS_RECORD writes
each distinct problem once (warm calls add nothing); `python -m kernels tune trace.jsonl` in a fresh cache tunes
them, after which a fresh process calling the same problems tunes nothing; a second tune run skips everything;
--time-limit 0 tunes nothing and says so. kernels.record() in code, concurrent appends, a trace that cannot be
written, and a bad KERNELS_RECORD."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernels
from kernels.core.cache_root import CacheWarning
from kernels.core.config import interpret_mode
from kernels.core.errors import SettingError
from tests.helpers import REPO, run_python

needs_interp = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")

SMALL = {"KERNELS_BACKENDS": "aten,triton", "TRITON_INTERPRET": "1", "KERNELS_RECORD": None}

# four distinct problems, each called three times (cold, then warm): fp16 mm, fp32 linear with a fused epilogue,
# fp16 mm with a strided A, and a dynamic-M mm with two size hints; the trace's size is printed after the first round
# and at the end
CALLS = textwrap.dedent("""
    import json, os, sys, torch, kernels
    kernels.config.benchmark_space = 1
    torch.manual_seed(0)
    a = torch.randn(24, 40).half(); b = torch.randn(40, 16).half()
    x = torch.randn(2, 3, 16); w = torch.randn(8, 16); bias = torch.randn(8)
    c = torch.randn(40, 40).half(); dyn = kernels.Dynamic("m", hints=(16, 64))
    trace = kernels.config.record
    sizes = []
    for _ in range(3):
        kernels.mm(a, b)
        kernels.linear(x, w, bias, activation="gelu")
        kernels.mm(a[:, :32], b[:32])
        kernels.mm(c, b, dynamic=dyn)
        sizes.append(os.path.getsize(trace) if trace else 0)
    kernels.explain(a, b)
    print(json.dumps({"stats": kernels.stats(), "sizes": sizes}))
""")

TUNE = "import sys, kernels\nkernels.config.benchmark_space = 1\nfrom kernels.__main__ import main\nsys.exit(main({}))\n"


def _report(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tune(args: list[str], cache) -> subprocess.CompletedProcess:
    """`python -m kernels tune ...` as a user runs it, with the tests' small benchmark space (a code-only setting)."""
    return run_python(TUNE.format(["tune", *args]), {**SMALL, "KERNELS_CACHE_DIR": str(cache)})


@needs_interp
def test_record_then_tune_then_a_fresh_process_does_not_tune(tmp_path):
    trace = tmp_path / "trace.jsonl"
    recorded = _report(run_python(CALLS, {**SMALL, "KERNELS_CACHE_DIR": str(tmp_path / "a"),
                                          "KERNELS_RECORD": str(trace)}))
    assert recorded["stats"]["tunes"] == 5                          # three static problems and two hints
    sizes = recorded["sizes"]
    assert sizes[0] > 0 and sizes[0] == sizes[1] == sizes[2]          # warm calls and explain add nothing
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert sorted((p["m"], p["k"], tuple(p["stride_a"]), p["bias"], p["activation"], p["dtype"], tuple(p["dynamic"]))
                  for p in lines) == [(6, 16, (16, 1), True, "gelu", "fp32", ()), (24, 32, (40, 1), False, "", "fp16", ()),
                                      (24, 40, (40, 1), False, "", "fp16", ()), (40, 40, (40, 1), False, "", "fp16", ("m",))]
    assert [p["dynamic_spec"]["hints"] for p in lines if p["dynamic"]] == [{"m": [16, 64]}]

    cache = tmp_path / "b"
    tuned = _tune([str(trace)], cache)
    assert tuned.returncode == 0, tuned.stderr[-3000:]
    assert "4 problems: 4 tuned, 0 in store, 0 failed, 0 left" in tuned.stdout
    assert "mm 6x8x16 fp32/ieee nt bias+gelu" in tuned.stdout and "mm 40x16x40 fp16 nn dynamic m" in tuned.stdout
    assert "[4/4]" in tuned.stderr

    fresh = _report(run_python(CALLS, {**SMALL, "KERNELS_CACHE_DIR": str(cache)}))
    assert fresh["stats"]["tunes"] == 0 and fresh["stats"]["benchmarks"] == 0 and fresh["stats"]["disk_hits"] == 5
    assert fresh["stats"]["bucket_benchmarks"] == 0 and fresh["stats"]["bucket_disk_hits"] == 1

    again = _tune([str(trace)], cache)
    assert again.returncode == 0 and "4 problems: 0 tuned, 4 in store, 0 failed, 0 left" in again.stdout

    dry = _tune([str(trace), "--dry-run"], cache)
    assert dry.returncode == 0 and "4 problems: 0 would be tuned, 3 in store, 1 dynamic" in dry.stdout


@needs_interp
def test_time_limit_zero_tunes_nothing_and_says_what_is_left(tmp_path):
    listed = tmp_path / "p.csv"
    listed.write_text("op,m,n,k,dtype,layout\nmm,16,16,16,fp16,nn\nmm,32,16,16,fp16,nt\n")
    cache = tmp_path / "c"
    proc = _tune([str(listed), "--time-limit", "0"], cache)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 problems: 0 tuned, 0 in store, 0 failed, 2 left" in proc.stdout
    assert "2 left (--time-limit 0 s reached): run the same command again" in proc.stdout
    assert not list((cache / "selections").glob("*.json")) if (cache / "selections").exists() else True


@pytest.fixture
def small_space(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,triton")
    monkeypatch.delenv("KERNELS_RECORD", raising=False)
    kernels.config.reset()
    kernels.config.benchmark_space = 1


@needs_interp
def test_record_in_code_writes_what_the_block_meets_once(tmp_path, small_space):
    trace = tmp_path / "in_code.jsonl"
    a, b = torch.randn(16, 32).half(), torch.randn(32, 8).half()
    kernels.mm(a, b)                                                   # before the block: warm inside it
    with kernels.record(trace) as where:
        assert where == str(trace)
        kernels.mm(a, b)                                               # warm: not looked up, not recorded
        kernels.mm(a[:8], b)
        kernels.clear_memory_cache()
        kernels.mm(a[:8], b)                                           # cold again: the same line is not repeated
    kernels.mm(a[:4], b)                                               # after the block: not recorded
    (line,) = trace.read_text().splitlines()
    assert json.loads(line)["m"] == 8


def test_processes_appending_to_one_trace_do_not_tear_lines(tmp_path):
    trace = tmp_path / "shared.jsonl"
    code = textwrap.dedent("""
        import sys, torch, kernels
        base = int(sys.argv[1])
        for m in range(base, base + 40):
            kernels.mm(torch.randn(m, 8), torch.randn(8, 8))
    """)
    env = {"KERNELS_CACHE_DIR": str(tmp_path / "cache"), "KERNELS_BACKENDS": "aten", "KERNELS_BENCH_MS": "0.1",
           "KERNELS_RECORD": str(trace), "TRITON_INTERPRET": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(base)], env={**os.environ, **env}, cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for base in (1, 101)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    ms = sorted(json.loads(line)["m"] for line in trace.read_text().splitlines())
    assert ms == list(range(1, 41)) + list(range(101, 141))


@needs_interp
def test_a_trace_that_cannot_be_written_warns_once_and_the_call_goes_on(tmp_path, small_space, monkeypatch):
    monkeypatch.setenv("KERNELS_RECORD", str(tmp_path / "no" / "such" / "dir" / "t.jsonl"))
    a, b = torch.randn(8, 16).half(), torch.randn(16, 8).half()
    with pytest.warns(CacheWarning, match="cannot append to the problem trace") as caught:
        first = kernels.mm(a, b)
        kernels.mm(a[:4], b)
    assert len([w for w in caught if "problem trace" in str(w.message)]) == 1
    torch.testing.assert_close(first.double(), a.double() @ b.double(), rtol=1e-2, atol=1e-2)


def test_a_directory_for_kernels_record_is_refused_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_RECORD", str(tmp_path))
    kernels.config.reset()
    with pytest.raises(SettingError, match=r"KERNELS_RECORD=.* is not valid: .* is a directory"):
        kernels.config.record
    with pytest.raises(ValueError, match="not a file path"):
        with kernels.record(tmp_path):
            pass
