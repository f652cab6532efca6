"""Where a fast-preset tune of a new M (binaries built) spends its time: stages + cProfile of the M+16 tune."""
import cProfile, io, os, pstats, sys, tempfile, time
os.environ["KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kprof_")
import torch
import kernels
from bench.fast_preset import cuda_problem, tuned
kernels.config.preset = "fast"
for (op, dt, m, n, k) in [("int_mm", "int8", 512, 4096, 11008), ("mm", "bf16", 96, 22016, 4096),
                          ("int_mm", "int8", 256, 256, 16384)]:
    first = tuned(cuda_problem(op, dt, m, n, k), ("aten", "triton"))
    print(first["selection"].table(rounds=True))
    for extra in (16, 32):
        pr = cProfile.Profile(); t = time.perf_counter(); pr.enable() if extra == 32 else None
        r = tuned(cuda_problem(op, dt, m + extra, n, k), ("aten", "triton"))
        pr.disable()
        print(f"== {op} {dt} {m + extra}x{n}x{k}: {time.perf_counter() - t:.2f} s, {r['compiles']} compiles, {r['benchmarks']} timed (first {first['seconds']:.2f} s)")
        print(r["selection"].table(rounds=True))
        if extra == 32:
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumtime").print_stats(40); print(s.getvalue()[-9000:])
        sys.stdout.flush()
# the same new M at a smaller benchmark budget: what the timing stages cost vs what the pick loses
for budget in (20.0, 10.0):
    kernels.config.bench_budget_ms = budget
    for (op, dt, m, n, k) in [("int_mm", "int8", 512, 4096, 11008), ("mm", "bf16", 96, 22016, 4096)]:
        r = tuned(cuda_problem(op, dt, m + 48 + int(budget), n, k), ("aten", "triton"))
        print(f"== budget {budget} {op} {dt} {m + 48 + int(budget)}x{n}x{k}: {r['seconds']:.2f} s")
        print(r["selection"].table(rounds=True)); sys.stdout.flush()
