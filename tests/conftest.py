"""Test setup. On a machine without CUDA, Triton runs through its interpreter: that must be decided before
triton is first imported, so it is set here, at collection time."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the C++ warm-call table is built (~15-25 s) only by the tests that are about it (tests/interp/test_fastpath.py, tests/gpu/test_fastpath.py)
os.environ.setdefault("KERNELS_FASTPATH", "off")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


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

