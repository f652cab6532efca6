"""The shared store end to end, through the interpreter, with a real redis-server: a tune publishes its selection,
and a fresh process in an empty cache reads it (no tune, no benchmark) and keeps a local copy; two processes meeting
the same new problem at once tune it once; a bad entry in the store is ignored and replaced; the store killed
mid-run leaves the caller's results right, with one warning."""
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import kernels
from kernels.core.cache_root import CacheWarning
from kernels.core.config import interpret_mode
from kernels.core.problem import GemmProblem
from kernels.store import shared
from kernels.store.selections import store_key
from kernels.tune.autotune import fingerprint
from tests.helpers import REPO, run_python

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")

SMALL = {"KERNELS_BACKENDS": "aten,triton", "TRITON_INTERPRET": "1", "KERNELS_RECORD": None}

# one new problem (fp16 24x16x40), checked against torch; prints kernels.stats() and the selection's source
CALL = textwrap.dedent("""
    import json, torch, kernels
    kernels.config.benchmark_space = 1
    torch.manual_seed(0)
    a = torch.randn(24, 40).half(); b = torch.randn(40, 16).half()
    out = kernels.mm(a, b)
    assert torch.allclose(out.float(), a.float() @ b.float(), atol=1e-2, rtol=1e-2)
    sel = kernels.explain(a, b)
    print(json.dumps({"stats": kernels.stats(), "winner": sel.winner, "source": sel.source}))
""")


def _call(cache, url, **env) -> dict:
    proc = run_python(CALL, {**SMALL, "KERNELS_CACHE_DIR": str(cache), "KERNELS_STORE": url, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_tune_is_published_and_a_fresh_machine_reads_it_without_tuning(redis_server, tmp_path):
    first = _call(tmp_path / "a", redis_server.url)
    assert first["stats"]["tunes"] == 1 and first["stats"]["store_publishes"] == 1
    second = _call(tmp_path / "b", redis_server.url)        # another machine: an empty cache
    s = second["stats"]
    assert (s["tunes"], s["benchmarks"], s["store_hits"]) == (0, 0, 1)
    assert second["winner"] == first["winner"]
    # the local copy: with the store gone, a third process here reads the disk
    redis_server.kill()
    third = _call(tmp_path / "b", "")
    assert (third["stats"]["tunes"], third["stats"]["disk_hits"]) == (0, 1)


def test_two_machines_meeting_a_new_problem_at_once_tune_it_once(redis_server, tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", CALL], cwd=str(REPO), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=_env(KERNELS_STORE=redis_server.url, KERNELS_CACHE_DIR=str(tmp_path / f"m{i}")))
             for i in range(2)]
    reports = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1])["stats"])
    assert sum(r["tunes"] for r in reports) == 1, reports
    reader = next(r for r in reports if r["tunes"] == 0)
    assert reader["store_hits"] == 1 and reader["benchmarks"] == 0


def _env(**extra) -> dict:
    """This process's environment with the small tune's settings and `extra` (None removes a variable)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), **SMALL, **extra}
    return {k: v for k, v in env.items() if v is not None}


def _problem_key(a, b) -> str:
    return store_key(GemmProblem.from_tensors("mm", a, b), fingerprint(kernels.config.backends))


def test_a_bad_entry_in_the_store_is_ignored_then_replaced_by_this_tune(redis_server):
    kernels.config.backends = ("aten", "triton")
    kernels.config.benchmark_space = 1
    kernels.config.store = redis_server.url
    a, b = torch.randn(24, 40).half(), torch.randn(40, 16).half()
    key = _problem_key(a, b)
    client = redis_server.client()
    client.set(shared.KEY_PREFIX + shared._digest(key), json.dumps({"key": key, "selection": {"winner": 1}}))
    with pytest.warns(CacheWarning, match="bad entry in the shared store"):
        out = kernels.mm(a, b)
    assert torch.allclose(out.float(), a.float() @ b.float(), atol=1e-2, rtol=1e-2)
    assert kernels.stats()["tunes"] >= 1
    stored = json.loads(client.get(shared.KEY_PREFIX + shared._digest(key)))
    assert stored["key"] == key and stored["selection"]["winner"] == kernels.explain(a, b).winner


def test_the_store_killed_mid_run_leaves_the_caller_right_with_one_warning(redis_server):
    kernels.config.backends = ("aten", "triton")
    kernels.config.benchmark_space = 1
    kernels.config.store = redis_server.url
    a, b = torch.randn(24, 40).half(), torch.randn(40, 16).half()
    kernels.mm(a, b)
    published = kernels.stats()["store_publishes"]
    redis_server.kill()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in (8, 24):                           # two new problems, after the store died
            c = torch.randn(40, n).half()
            out = kernels.mm(a, c)
            assert torch.allclose(out.float(), a.float() @ c.float(), atol=1e-2, rtol=1e-2)
    assert sum("shared store" in str(w.message) for w in caught) == 1
    s = kernels.stats()
    assert s["store_publishes"] == published and s["store_errors"] >= 1
