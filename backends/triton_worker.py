"""A compile worker: `python -m backends.triton_worker` reads one JSON job per line on stdin and answers one JSON
result per line on stdout. It never touches a GPU (it compiles for an explicit target) and imports no torch.

Jobs are compiled into Triton's cache (TRITON_CACHE_DIR, set by the parent), where the parent's own
`triton.compile` of the same source then finds them.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

from backends import triton_modules

_modules: dict = {}


def load_kernel(module_path: str, kernel_name: str):
    """Load a rendered module once per process, from its content-checked bytes (backends.triton_modules), and
    return its kernel function."""
    mod = _modules.get(module_path)
    if mod is None:
        mod = triton_modules.load(module_path, "kernels_gen_" + os.path.basename(module_path)[:-3])
        _modules[module_path] = mod
    return getattr(mod, kernel_name)


def ast_source(fn, signature: dict, div16: list[int]):
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in div16}
    return ASTSource(fn, signature, attrs=attrs)


def gpu_target(backend: str, arch: int, warp_size: int):
    from triton.backends.compiler import GPUTarget

    return GPUTarget(backend, arch, warp_size)


def compile_job(job: dict):
    """Compile one job; returns the CompiledKernel (the parent calls this too, to hit the cache)."""
    import triton

    fn = load_kernel(job["module_path"], job["kernel_name"])
    src = ast_source(fn, job["signature"], job["div16"])
    target = gpu_target(job.get("backend", "cuda"), job["arch"], job.get("warp_size", 32))
    return triton.compile(src, target=target, options=dict(job["options"]))


def load_cached(job: dict, folder: str, files, kernel_hash: str):
    """The CompiledKernel of a job whose compiled files sit in `folder` (their names `files`), made as triton.compile
    makes it on a cache hit, without the cache key: computing that key hashes Triton's own installation once per
    process (0.43 s of a fresh process's first call on the H100 host). The caller vouches for the files: checked
    against their recorded hashes, or hashed just now from its own compile."""
    from triton.compiler.compiler import CompiledKernel

    fn = load_kernel(job["module_path"], job["kernel_name"])
    src = ast_source(fn, job["signature"], job["div16"])
    group = {name: os.path.join(folder, name) for name in files if not name.startswith("__grp__")}
    return CompiledKernel(src, group, kernel_hash)


def cache_group(kernel_hash: str) -> str:
    """The folder name Triton's file cache uses for a kernel (it encodes the hash; the encoding varies by version)."""
    from triton.runtime.cache import get_cache_manager

    return os.path.basename(os.path.normpath(get_cache_manager(kernel_hash).cache_dir))


def _serve() -> None:
    os.environ.pop("TRITON_INTERPRET", None)
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        start = time.perf_counter()
        try:
            kernel = compile_job(job)
            result = {"id": job["id"], "ok": True, "hash": kernel.hash, "cache_group": cache_group(kernel.hash),
                      "shared": int(getattr(kernel.metadata, "shared", 0))}
        except BaseException as e:  # noqa: BLE001 - a failed compile is a result, not a crash of the worker
            text = "".join(traceback.format_exception_only(type(e), e)).strip()
            result = {"id": job["id"], "ok": False, "error": text[-4000:], "trace": traceback.format_exc()[-8000:]}
        result["seconds"] = time.perf_counter() - start
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
