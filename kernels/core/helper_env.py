"""The environment every helper process of ours starts with (compile workers, the isolated child, tune workers)."""
from __future__ import annotations

import os

from kernels.core.cache_root import cache_root
from kernels.core.toolchain import REPO_ROOT


def child_environment() -> dict:
    """This process's environment, with the checkout importable and the cache directory this process checked (or its
    private fallback), so the helper uses the same one; the device choice (CUDA_VISIBLE_DEVICES) is kept."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["KERNELS_CACHE_DIR"] = str(cache_root())
    return env
