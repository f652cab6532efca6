"""What a cold Triton compile pool costs before its first kernel: two batches of MAX_JOBS distinct kernels (bf16
triton_mm tiles for sm90) through a fresh pool, the first batch paying the workers' start (Python, Triton, its
backend's first compile), the second not. Prints one JSON line. `python -m experiments.compile_pool_start` (no GPU
needed; run with an empty TRITON_CACHE_DIR / KERNELS_CACHE_DIR so that nothing is a cache hit).
"""
from __future__ import annotations

import json
import time

from backends.triton import TritonBackend
from backends.triton_modules import module_file_name
from backends.triton_render import render
from backends.triton_templates import family
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.fsutil import write_if_different
from kernels.core.problem import GemmProblem
from kernels.space.heuristics import GemmConfig

TILES = [(bm, bn, bk, s, w) for bm in (64, 128) for bn in (64, 128, 256) for bk in (32, 64)
         for s, w in ((3, 4), (4, 8), (5, 4))]


def _jobs(backend: TritonBackend, configs) -> list[dict]:
    problem = GemmProblem("mm", 4096, 4096, 4096, "bf16", "bf16", (4096, 1), (1, 4096), 16, 16, "cuda", 90, "h100")
    jobs = []
    for cfg in configs:
        choice = Choice("triton", "triton_mm", "bf16", GemmConfig(*cfg))
        for spec in family(choice.template).specs(problem, choice):
            source = render(spec)
            path = backend.root / "src" / module_file_name(f"pool_start_{len(jobs)}", source)
            write_if_different(path, source)
            jobs.append(dict(backend._job(problem, spec, path), id=len(jobs)))
    return jobs


def main() -> int:
    size = config.max_jobs
    backend = TritonBackend()
    first, second = _jobs(backend, TILES[:size]), _jobs(backend, TILES[size:2 * size])
    try:
        t0 = time.perf_counter()
        pool = backend._get_pool()
        results = pool.map(first)
        t1 = time.perf_counter()
        results += pool.map(second)
        t2 = time.perf_counter()
    finally:
        backend.close()
    print(json.dumps({"workers": size, "first_batch": len(first), "second_batch": len(second),
                      "first_batch_s": round(t1 - t0, 3), "second_batch_s": round(t2 - t1, 3),
                      "ok": sum(bool(r.get("ok")) for r in results),
                      "compile_s": [round(r.get("seconds", 0.0), 3) for r in results]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
