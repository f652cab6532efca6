"""Bundles across processes: tune in one cache, `cache export`, `cache import` into an empty cache in a fresh process,
and a third process calls the problems without a tune, a benchmark or a compile; compiled Triton kernels (sm90,
compiled without a GPU) travel with their files, which Triton's own cache then finds at their new place."""
import dataclasses
import json
import os
import shutil
import textwrap

import pytest

from kernels.core.config import interpret_mode
from kernels.store import bundle, environment
from tests.helpers import run_python

needs_interp = pytest.mark.skipif(not interpret_mode(), reason="exercised through the interpreter on CPU")

CALLS = textwrap.dedent("""
    import json, torch, kernels
    kernels.config.benchmark_space = 1          # the performance model's top pick per backend: a fast tune
    torch.manual_seed(0)
    a, b = torch.randn(24, 40).half(), torch.randn(40, 16).half()
    x, w, bias = torch.randn(8, 32), torch.randn(16, 32), torch.randn(16)
    c = kernels.mm(a, b)
    y = kernels.linear(x, w, bias, activation="relu")
    ok = bool(torch.allclose(c.float(), (a.float() @ b.float()), atol=2e-2)
              and torch.allclose(y, torch.relu(x @ w.t() + bias), atol=1e-4))
    print(json.dumps({"stats": kernels.stats(), "ok": ok}))
""")


def _last_json(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cli(args: str, cache, env=None):
    code = f"import sys; from kernels.__main__ import main; sys.exit(main({args.split()!r}))"
    proc = run_python(code, {"KERNELS_CACHE_DIR": str(cache), **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@needs_interp
def test_export_import_into_an_empty_cache_then_a_fresh_process_does_not_tune(tmp_path):
    env = {"TRITON_INTERPRET": "1", "KERNELS_BACKENDS": "aten,triton"}
    tuned, fresh, path = tmp_path / "tuned", tmp_path / "fresh", tmp_path / "model.tar.gz"
    first = _last_json(run_python(CALLS, {"KERNELS_CACHE_DIR": str(tuned), **env}))
    assert first["ok"] and first["stats"]["tunes"] == 2
    assert "2 selections" in _cli(f"cache export {path}", tuned, env)
    assert "imported 2 selections" in _cli(f"cache import {path}", fresh, env)
    second = _last_json(run_python(CALLS, {"KERNELS_CACHE_DIR": str(fresh), **env}))
    assert second["ok"]
    stats = second["stats"]
    assert stats["tunes"] == 0 and stats["benchmarks"] == 0 and stats["compiles"] == 0 and stats["disk_hits"] == 2


COMPILE_AND_STORE = textwrap.dedent("""
    import time
    from backends import get_backend
    from kernels.core.choice import Choice
    from kernels.core.config import config
    from kernels.core.selection import Selection
    from kernels.space.heuristics import GemmConfig
    from kernels.store.selections import SelectionStore, store_key
    from kernels.tune.autotune import fingerprint
    from tests.helpers import problem
    p = problem(m=64, n=64, k=64, dtype="fp16")
    choice = Choice("triton", "triton_mm", "fp16", GemmConfig(32, 32, 32, 2, 4))
    backend = get_backend("triton")
    outcome, = backend.build(p, [choice])        # compiles for sm90 in a worker; loading needs a GPU
    assert outcome.compiled and backend.built(p, [choice]) == {choice.name}, outcome.error
    backend.close()
    sel = Selection(problem=p, winner=choice.name, choices={choice.name: choice}, timings={choice.name: 0.01},
                    created=time.time())
    SelectionStore().put(store_key(p, fingerprint(config.backends)), sel)
""")

LOAD_CHECK = textwrap.dedent("""
    import json, os
    from backends import get_backend
    from backends.triton import _triton_cache_at
    from backends.triton_worker import compile_job
    from backends.triton_render import build_key, render
    from backends.triton_templates import family
    from kernels.core.choice import Choice
    from kernels.space.heuristics import GemmConfig
    from tests.helpers import problem
    p = problem(m=64, n=64, k=64, dtype="fp16")
    choice = Choice("triton", "triton_mm", "fp16", GemmConfig(32, 32, 32, 2, 4))
    backend = get_backend("triton")
    built = sorted(backend.built(p, [choice]))
    record = json.loads(next((backend.root / "artifacts").glob("*.json")).read_text())
    folder = backend.triton_cache_dir / record["cache_group"]
    before = {f.name: f.stat().st_ino for f in folder.iterdir()}
    outcome, = backend.build(p, [choice])        # no worker compile: the artifact store has it
    spec, = family("triton_mm").specs(p, choice)
    with _triton_cache_at(backend.triton_cache_dir):     # what a load does: Triton's own cache must hit
        kernel = compile_job(backend._job(p, spec, backend.root / "src" / os.listdir(backend.root / "src")[0]))
    after = {f.name: f.stat().st_ino for f in folder.iterdir()}
    index = json.loads(next(folder.glob("__grp__*")).read_text())["child_paths"]
    print(json.dumps({"built": built, "compiled": outcome.compiled, "same_files": before == after,
                      "hash": kernel.hash == record["triton_hash"],
                      "index_here": all(v.startswith(str(folder)) and os.path.exists(v) for v in index.values())}))
""")


@pytest.mark.slow
def test_a_compiled_triton_winner_travels_and_triton_finds_it_at_its_new_place(tmp_path, monkeypatch):
    compiled, fresh, path = tmp_path / "compiled", tmp_path / "fresh", tmp_path / "triton.tar.gz"
    no_interp = {"TRITON_INTERPRET": None, "KERNELS_BACKENDS": "aten,triton"}
    proc = run_python(COMPILE_AND_STORE, {"KERNELS_CACHE_DIR": str(compiled), **no_interp})
    assert proc.returncode == 0, proc.stderr[-3000:]
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,triton")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(compiled))
    report = bundle.export_bundle(path)
    assert report.selections == 1 and report.artifacts > 2 and not report.missing
    shutil.rmtree(compiled)                        # Triton's index there named files by this path: gone now
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(fresh))
    machine = dataclasses.replace(environment.here(toolchain=False), gpus=(("test", 90),))
    imported = bundle.import_bundle(path, machine=machine)
    assert len(imported.imported) == 1 and imported.artifacts_written == 1
    check = _last_json(run_python(LOAD_CHECK, {"KERNELS_CACHE_DIR": str(fresh), **no_interp}))
    assert check == {"built": ["triton_mm_fp16_32x32x32_s2_w4_g8"], "compiled": False, "same_files": True,
                     "hash": True, "index_here": True}
    assert not os.path.exists(compiled)
