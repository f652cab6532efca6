"""Test setup. On a machine without CUDA, Triton runs through its interpreter: that must be decided before
triton is first imported, so it is set here, at collection time."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# the C++ warm-call table is built (~15-25 s) only by the tests that are about it (tests/test_fastpath.py)
os.environ.setdefault("KERNELS_FASTPATH", "off")

REPO = Path(__file__).resolve().parent.parent


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


def run_python(code: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter with the repo importable; env entries set to None are removed."""
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = str(REPO) + os.pathsep + full_env.get("PYTHONPATH", "")
    for k, v in (env or {}).items():
        if v is None:
            full_env.pop(k, None)
        else:
            full_env[k] = v
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env,
                          timeout=timeout, cwd=str(REPO))
