"""GPU: dynamic M serves every new M with a hint winner's binary (no compile), correctly, in both modes; a new process
reads the bucket decisions instead of benchmarking."""
import json
import textwrap

import pytest
import torch

import kernels
from kernels.core import counters
from kernels.dispatch import dynamic as dyn_mod
from tests.helpers import run_python

pytestmark = pytest.mark.gpu


def rel_err(c, a, b):
    ref = a.double() @ b.double()
    return float((c.double() - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", ["benchmark", "similarity"])
def test_new_m_loads_and_never_compiles(mode):
    counters.reset()
    dyn = kernels.Dynamic("m", hints=(16, 128, 1024), mode=mode)
    b = torch.randn(512, 768, device="cuda", dtype=torch.bfloat16)
    kernels.mm(torch.randn(16, 512, device="cuda", dtype=torch.bfloat16), b, dynamic=dyn)
    after_hints = kernels.stats()
    assert after_hints["tunes"] == 3
    for m in (1, 7, 17, 100, 129, 333, 1000, 2047, 5000):
        a = torch.randn(m, 512, device="cuda", dtype=torch.bfloat16)
        c = kernels.mm(a, b, dynamic=dyn)
        assert c.shape == (m, 768) and rel_err(c, a, b) < 1e-2
        d = kernels.explain(a, b, dynamic=dyn).decision
        served = d.hint_winners.values() if mode == "similarity" else \
            next(iter(dyn_mod._families.values())).pool_names(dyn_mod.DYNAMIC_POOL)
        assert d.mode == mode and d.winner in served        # benchmark mode: a hint's winner or runner-up
    s = kernels.stats()
    assert s["compiles"] == after_hints["compiles"] and s["tunes"] == 3
    if mode == "similarity":
        assert s["bucket_benchmarks"] == 0


SERVE = textwrap.dedent("""
    import json, torch, kernels
    dyn = kernels.Dynamic("m", hints=(16, 256), mode="benchmark")
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    out = {}
    for m in (3, 40, 300, 3000):
        a = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        kernels.mm(a, b, dynamic=dyn)
        out[m] = kernels.explain(a, b, dynamic=dyn).decision.winner
    print(json.dumps({"winners": out, "stats": kernels.stats()}))
""")


def test_bucket_decisions_persist_on_gpu(isolated_cache):
    env = {"KERNELS_CACHE_DIR": str(isolated_cache)}
    runs = []
    for _ in range(2):
        proc = run_python(SERVE, env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[1]["winners"] == runs[0]["winners"]
    s = runs[1]["stats"]
    assert s["tunes"] == 0 and s["bucket_benchmarks"] == 0 and s["compiles"] == 0 and s["benchmarks"] == 0
