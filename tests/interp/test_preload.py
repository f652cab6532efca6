"""kernels.preload(): a fresh process loads and verifies the stored winners of its device up front, after which the
first calls are memory hits (no load, tune or benchmark); with a problem list it loads those and names the ones the
store lacks, never tuning them."""
import json
import textwrap

import pytest

from kernels.core.config import interpret_mode
from tests.helpers import run_python

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")

SMALL = {"KERNELS_BACKENDS": "aten,triton", "TRITON_INTERPRET": "1", "KERNELS_RECORD": None}

CALLS = textwrap.dedent("""
    import json, sys, torch, kernels
    kernels.config.benchmark_space = 1
    torch.manual_seed(0)
    a = torch.randn(24, 40).half(); b = torch.randn(40, 16).half()
    x = torch.randn(2, 3, 16); w = torch.randn(8, 16); bias = torch.randn(8)
    report = None
    if sys.argv[1] != "none":
        report = kernels.preload(None if sys.argv[1] == "all" else sys.argv[1])
    before = kernels.stats()
    out = kernels.mm(a, b)
    assert torch.allclose(out.float(), a.float() @ b.float(), atol=1e-2, rtol=1e-2)
    y = kernels.linear(x, w, bias, activation="gelu")
    assert torch.allclose(y, torch.nn.functional.gelu(x @ w.t() + bias, approximate="tanh"), atol=1e-4)
    after = kernels.stats()
    moved = {k: after[k] - before[k] for k in ("tunes", "benchmarks", "disk_hits", "compiles", "artifact_loads")}
    print(json.dumps({"report": report and {"loaded": report.loaded, "missing": report.missing}, "moved": moved}))
""")


def _run(cache, arg):
    proc = run_python(CALLS.replace("sys.argv[1]", repr(arg)), {**SMALL, "KERNELS_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_preload_makes_every_first_call_a_memory_hit(tmp_path):
    cache = tmp_path / "cache"
    tuned = _run(cache, "none")
    assert tuned["moved"]["tunes"] == 2
    loaded = _run(cache, "all")
    assert loaded["report"] == {"loaded": 2, "missing": []}
    assert loaded["moved"] == {"tunes": 0, "benchmarks": 0, "disk_hits": 0, "compiles": 0, "artifact_loads": 0}


def test_preload_of_a_list_loads_what_is_stored_and_names_the_rest_without_tuning(tmp_path):
    cache = tmp_path / "cache"
    _run(cache, "none")
    listed = tmp_path / "problems.csv"
    listed.write_text("op,m,n,k,dtype,layout\nmm,24,16,40,fp16,nn\nmm,64,64,64,fp16,nn\n")
    loaded = _run(cache, str(listed))
    assert loaded["report"]["loaded"] == 1 and len(loaded["report"]["missing"]) == 1
    assert "64x64x64" in loaded["report"]["missing"][0]
    # the linear problem was not listed: its first call loads it from the store, still without a tune
    assert loaded["moved"]["tunes"] == 0 and loaded["moved"]["disk_hits"] == 1
