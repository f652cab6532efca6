"""Test setup. On a machine without CUDA, Triton runs through its interpreter: that must be decided before
triton is first imported, so it is set here, at collection time."""
import os
import shutil
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the C++ warm-call table is built (~15-25 s) only by the tests that are about it (the `fast` fixture below)
os.environ.setdefault("KERNELS_FASTPATH", "off")


pytest_plugins = ["tests.redis_server"]     # the redis_server fixture: a real server for the shared store's tests

GPU_MARKS = ("gpu", "gpu_sweep")
GPU_DIR = Path(__file__).resolve().parent / "gpu"


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA; a test is a GPU test exactly when it lives in tests/gpu (a collection error
    otherwise, so `pytest -m gpu` and the folders cannot drift apart)."""
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
    misfiled = []
    for item in items:
        on_gpu = any(item.get_closest_marker(mark) for mark in GPU_MARKS)
        if on_gpu != (GPU_DIR in item.path.parents):
            misfiled.append(item.nodeid)
        if on_gpu and not HAS_CUDA:
            item.add_marker(skip_gpu)
    if misfiled:
        raise pytest.UsageError("tests marked gpu or gpu_sweep belong in tests/gpu, and tests there need one of the "
                                f"two marks: {misfiled[:5]}")


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    """Each test gets its own cache dir and a clean in-memory state."""
    import kernels

    cache = tmp_path_factory.mktemp("kcache")
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(cache))
    kernels.config.reset()
    kernels.clear_memory_cache()
    yield cache
    kernels.config.reset()
    kernels.clear_memory_cache()


# kernels is imported inside the fixtures: importing it here, before TRITON_INTERPRET is set above, would import
# triton in the wrong mode


@pytest.fixture(scope="session")
def built_library(tmp_path_factory):
    """The C++ warm-call table, built once for the session (~15-25 s on 2 cores)."""
    from kernels.native import fastpath

    folder = tmp_path_factory.mktemp("fastpath_build")
    mp = pytest.MonkeyPatch()
    mp.setenv("KERNELS_CACHE_DIR", str(folder))
    try:
        return fastpath.build()
    finally:
        mp.undo()


@pytest.fixture
def fast(built_library, monkeypatch):
    """The library in this test's cache dir, KERNELS_FASTPATH=auto, and a fresh Fastpath state (restored after)."""
    import kernels
    from kernels.dispatch import api, scaled
    from kernels.native import fastpath

    where = fastpath.paths()
    where.folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(built_library, where.library)
    shutil.copy(built_library.parent / where.marker.name, where.marker)     # same tag: the marker vouches for it
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    monkeypatch.setattr(api, "_fast", fastpath.Fastpath())
    monkeypatch.setattr(api, "_fast_call", None)
    monkeypatch.setattr(scaled, "_table", None)       # kernels.scaled_mm's view of the same table
    monkeypatch.setattr(scaled, "_fast_call", None)
    kernels.config.backends = ("aten",)
    # isolated_cache's teardown (clear_memory_cache) runs while api._fast is still this one: it empties this copy's
    # table, which the ops' C++ dispatcher kernels may be bound to for the rest of the session
    return where


@pytest.fixture
def fresh_cache_checks(monkeypatch):
    """The cache directory's checks and their once-only warnings made anew for the test, aten only (the store and
    trust tests)."""
    import kernels
    from kernels.core import cache_root

    cache_root.forget()
    monkeypatch.setattr(cache_root, "_warned", set())
    kernels.config.backends = ("aten",)
    yield
    cache_root.forget()

