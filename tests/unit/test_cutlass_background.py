"""The background CUTLASS build (KERNELS_CUTLASS_BUILD=background) with a fake nvcc (tests/fake_cutlass.py): a tune
never compiles and marks what it lacked pending; the builder builds it; the next cold lookup re-tunes with it; a
failed compile is recorded, not retried, and leaves the problem on what it had, re-tuned once, not in a loop."""
import json
import os
import threading

import pytest
import torch

import kernels
from backends.cutlass import CutlassBackend
from kernels.core.cache_root import CacheWarning
from kernels.core.config import config
from kernels.tune import background_build, build_queue
from tests import fake_cutlass
from tests.helpers import problem, run_python


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake toolchain; builders are not started as processes here: the test runs them (in this process)."""
    tools = fake_cutlass.make_toolchain(tmp_path / "toolchain")
    started = []
    monkeypatch.setattr(build_queue, "start_builder", lambda w: started.append(w))
    tools.started = started
    return tools


@pytest.fixture
def served(fake, monkeypatch):
    """kernels.mm on CPU tensors with aten and a CUTLASS backend whose kernels (fake-built) compute on the CPU."""
    fake_cutlass.install(monkeypatch, fake_cutlass.CpuServedCutlass(fake.tools))
    config.backends = ("aten", "cutlass")
    config.bench_budget_ms = 2
    return fake


def cold_lookup(a, b):
    """A lookup in a fresh process, as far as the selection goes: memory forgotten, the store kept."""
    kernels.clear_memory_cache()
    before = kernels.stats()["tunes"]
    sel = kernels.explain(a, b)
    return sel, kernels.stats()["tunes"] - before


def cutlass_names(sel):
    return [n for n, c in sel.choices.items() if c.backend == "cutlass"]


def test_tune_builds_nothing_marks_pending_then_the_build_and_a_cold_lookup_bring_cutlass_in(served):
    a, b = torch.randn(48, 64, dtype=torch.float16), torch.randn(64, 64, dtype=torch.float16)
    sel, tunes = cold_lookup(a, b)
    assert tunes == 1 and served.compiles() == [] and sel.winner == "aten_mm"
    names = cutlass_names(sel)
    assert names and sorted(sel.pending) == sorted(names)
    assert all(sel.timings[n].startswith("pending: ") for n in names)
    assert "being built in the background" in sel.table()
    assert len(served.started) == 1 and len(build_queue.queued(build_queue.where())) == 1

    # still pending: the stored selection serves (no re-tune), and the request stands
    sel, tunes = cold_lookup(a, b)
    assert tunes == 0 and sel.source == "disk" and sel.pending

    assert background_build.run_builder(build_queue.where(), jobs=2)
    assert len(served.compiles()) == len(set(served.compiles())) > 0       # each binary compiled once
    assert build_queue.queued(build_queue.where()) == {}
    state = background_build.read_state(build_queue.where())
    assert state["finished"] and state["compiled"] == len(served.compiles()) and state["failed"] == 0

    with pytest.warns(CacheWarning, match="re-tuning mm 48x64x64.*being built in the background, which are done"):
        sel, tunes = cold_lookup(a, b)        # built now: the stored selection is stale, re-tuned with CUTLASS
    assert tunes == 1 and sel.pending == []
    assert all(isinstance(sel.timings[n], float) for n in cutlass_names(sel)), sel.table()
    sel, tunes = cold_lookup(a, b)
    assert tunes == 0 and sel.source == "disk"
    assert len(served.compiles()) == len(set(served.compiles()))           # the re-tune compiled nothing


def test_a_failed_build_is_recorded_keeps_the_problem_off_cutlass_with_why_and_is_not_retried(served):
    served.fail_when_source_has("cutlass")          # every CUTLASS source
    a, b = torch.randn(32, 64, dtype=torch.float16), torch.randn(64, 64, dtype=torch.float16)
    sel, _ = cold_lookup(a, b)
    assert sel.pending
    background_build.run_builder(build_queue.where(), jobs=2)
    compiles = len(served.compiles())         # a failed translation unit's kernels are compiled again one by one
    assert compiles > 0 and background_build.read_state(build_queue.where())["failed"] == len(set(served.compiles()))

    with pytest.warns(CacheWarning, match="re-tuning mm 32x64x64"):
        sel, tunes = cold_lookup(a, b)        # settled (failed): one re-tune, which records why
    assert tunes == 1 and sel.pending == [] and sel.winner == "aten_mm"
    why = sel.timings[cutlass_names(sel)[0]]
    assert why.startswith("compile failed in an earlier build, not retried") and "fake nvcc refuses" in why
    for _ in range(2):                        # and no loop: later cold lookups serve it, nothing is rebuilt
        sel, tunes = cold_lookup(a, b)
        assert tunes == 0 and sel.source == "disk"
    background_build.run_builder(build_queue.where(), jobs=2)
    assert len(served.compiles()) == compiles


def test_inline_compiles_in_the_tune_and_off_builds_nothing(served):
    a, b = torch.randn(64, 64, dtype=torch.float16), torch.randn(64, 64, dtype=torch.float16)
    config.cutlass_build = "off"
    sel, _ = cold_lookup(a, b)
    assert sel.pending == [] and served.compiles() == [] and not served.started
    assert sel.timings[cutlass_names(sel)[0]].startswith("not built, and KERNELS_CUTLASS_BUILD=off")
    config.cutlass_build = "inline"
    b = torch.randn(64, 128, dtype=torch.float16)           # a new problem
    sel = kernels.explain(a, b)
    assert served.compiles() and sel.pending == []
    assert all(isinstance(sel.timings[n], float) for n in cutlass_names(sel)), sel.table()


def test_a_pending_selection_is_stale_once_background_builds_are_turned_off(served):
    a, b = torch.randn(16, 64, dtype=torch.float16), torch.randn(64, 64, dtype=torch.float16)
    assert cold_lookup(a, b)[0].pending
    config.cutlass_build = "off"
    with pytest.warns(CacheWarning, match="re-tuning mm 16x64x64"):
        sel, tunes = cold_lookup(a, b)
    assert tunes == 1 and sel.pending == []


def test_a_killed_builder_is_started_again_by_the_next_cold_lookup(served):
    a, b = torch.randn(64, 64, dtype=torch.float16), torch.randn(64, 64, dtype=torch.float16)
    cold_lookup(a, b)
    assert len(served.started) == 1           # ... and it died before building anything
    cold_lookup(a, b)
    assert len(served.started) == 2 and len(build_queue.queued(build_queue.where())) == 1


def test_two_requests_for_one_problem_are_one_request_and_one_build(fake, monkeypatch):
    backend = fake_cutlass.install(monkeypatch, fake_cutlass.CpuServedCutlass(fake.tools))
    p = problem(64, 64, 64, dtype="fp16", arch=0)           # CPU: no default set to build besides
    choices = backend.choices(p)[0][:3]
    assert build_queue.request(p, choices) is None and build_queue.request(p, choices) is None
    assert len(build_queue.queued(build_queue.where())) == 1
    background_build.run_builder(build_queue.where(), jobs=2)
    binaries = {backend.artifact_paths(p, c)[0] for c in choices}
    assert len(fake.compiles()) == len(binaries) and all(backend.state(p, c) == "built" for c in choices)


def test_one_builder_at_a_time_and_a_request_made_meanwhile_is_built_by_it(fake, monkeypatch):
    """Builder 1 holds the lock while it compiles; builder 2 gives up at once, and a request made meanwhile starts no
    builder: builder 1 sees it after its batch."""
    backend = fake_cutlass.install(monkeypatch, CutlassBackend(fake.tools))
    monkeypatch.setattr(background_build, "BUILDER_LOCK_WAIT_S", 0.05)
    compiling, release = threading.Event(), threading.Event()
    real_compile = CutlassBackend._compile

    def gated_compile(self, todo, max_jobs=None, on_progress=None):
        compiling.set()
        assert release.wait(30)
        real_compile(self, todo, max_jobs, on_progress)

    monkeypatch.setattr(CutlassBackend, "_compile", gated_compile)
    first, second = problem(4096, 4096, 4096), problem(1024, 8192, 2048, lb="col")
    w = build_queue.where()
    build_queue.request(first, backend.choices(first)[0][:2])
    assert len(fake.started) == 1
    results = {}
    builder = threading.Thread(target=lambda: results.setdefault("one", background_build.run_builder(w, jobs=2)))
    builder.start()
    assert compiling.wait(30)
    assert background_build.run_builder(w, jobs=2) is False          # the lock is held: nothing done here
    assert background_build.describe(w).startswith(f"running (pid {os.getpid()}, low priority): 1 asking problem")
    build_queue.request(second, backend.choices(second)[0][:2])
    assert len(fake.started) == 1                                     # a builder runs: none started
    release.set()
    builder.join(60)
    assert results["one"] is True and build_queue.queued(w) == {}
    assert background_build.describe(w).startswith(f"finished 0 min ago: {len(fake.compiles())} compiled, 0 failed")
    for p in (first, second):
        assert all(backend.state(p, c) == "built" for c in backend.choices(p)[0][:2])
    default_sets = {k for p in (first, second) for k in background_build.default_set(90, p.dtype).kernels}
    assert len(fake.compiles()) == len(set(fake.compiles())) >= len(default_sets)


def test_bad_request_and_state_files_are_ignored(fake, monkeypatch):
    w = build_queue.where()
    w.requests.mkdir(parents=True)
    (w.requests / "bad.json").write_text("{not json")
    (w.requests / "other.json").write_text(json.dumps({"schema": 1, "problem": {}, "choices": []}))
    assert build_queue.queued(w) == {} and not list(w.requests.iterdir())
    w.state.write_text(json.dumps({"pid": "x"}))
    assert background_build.read_state(w) is None
    assert background_build.describe(w) == "none has run"


def test_the_detached_builder_runs_at_low_priority_and_builds_the_asked_kernels_and_the_default_set(fake, tmp_path):
    """The real process: started detached by the request, niced, through ninja and the fake nvcc on its PATH."""
    code = """
from backends import get_backend
from kernels.tune import background_build, build_queue, warmup
from tests.helpers import problem
p = problem(4096, 11008, 4096, lb="col")
backend = get_backend("cutlass")
assert backend.available(p)[0], backend.available(p)
choices = backend.choices(p)[0][:2]
assert build_queue.request(p, choices) is None
proc = build_queue._started[-1]
assert proc.wait(120) == 0
w = build_queue.where()
assert build_queue.queued(w) == {}
assert all(backend.state(p, c) == "built" for c in choices)
cset = warmup.default_set(90, "bf16")
assert cset.states()["built"] == len(cset.kernels), cset.states()
binary = backend.artifact_paths(p, choices[0])[1].binary
print(binary.read_text().strip().rsplit(" ", 1)[-1], background_build.read_state(w)["compiled"], len(cset.kernels))
"""
    env = dict(fake.environment(), KERNELS_CACHE_DIR=str(tmp_path / "cache"), MAX_JOBS="4")
    proc = run_python(code, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    niceness, compiled, in_set = proc.stdout.split()
    assert niceness == "19" and int(compiled) >= int(in_set) > 0
