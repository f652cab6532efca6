"""Issue 29's measurement, the importing side: in a fresh process (after `kernels cache import`), the first call of
every listed problem through the public API as a user makes it (kernels.mm / kernels.linear on fresh operands with
the listed layout), each timed with a sync, and what the library did meanwhile (kernels.stats(): tunes, benchmarks,
compiles). Not a test: one JSON line per problem, then a summary line.

    python -m experiments.bundle_first_calls layer.csv [--profile top.txt]

Before the timed calls it times, apart, what any process pays once whatever the library: CUDA's context and cuBLAS's
handle (a first torch.mm) and, with --init-triton, importing Triton and starting its driver; `--profile` writes the
30 costliest functions (cumulative) of the timed calls.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time

import torch

import kernels
from kernels.measure.verify import make_inputs
from kernels.tune.problem_list import read_all, retarget


def _first_call(problem, operands):
    a, b = operands[0], operands[1]
    if problem.bias or problem.activation:
        bias = operands[2] if problem.bias else None
        return kernels.linear(a, b.t(), bias, activation=problem.activation or None)
    return kernels.mm(a, b) if problem.op == "mm" else kernels.int_mm(a, b)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.bundle_first_calls", description=__doc__)
    ap.add_argument("problems", nargs="+")
    ap.add_argument("--init-triton", action="store_true", help="import Triton and start its driver before timing")
    ap.add_argument("--profile", help="write the timed calls' costliest functions here")
    ap.add_argument("--preload", action="store_true", help="kernels.preload() the listed problems before timing")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    torch.cuda.init()
    t0 = time.perf_counter()
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)
    torch.cuda.synchronize()
    init = {"first_torch_mm_ms": round((time.perf_counter() - t0) * 1e3, 1)}
    if args.init_triton:
        t0 = time.perf_counter()
        import triton
        _ = triton.runtime.driver.active.utils
        init["triton_init_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
    if args.preload:
        t0 = time.perf_counter()
        report = kernels.preload(args.problems)
        init["preload_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        init["preloaded"] = report.loaded
    print(json.dumps({"process_init": init}), flush=True)
    profile = cProfile.Profile() if args.profile else None
    cap = torch.cuda.get_device_capability()
    listed = retarget(read_all(args.problems), "cuda", cap[0] * 10 + cap[1], torch.cuda.get_device_name())
    before = kernels.stats()
    worst, total = 0.0, 0.0
    for item in listed:
        operands = make_inputs(item.problem, "cuda", seed=1)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        _first_call(item.problem, operands)
        torch.cuda.synchronize()
        if profile is not None:
            profile.disable()
        ms = (time.perf_counter() - t0) * 1e3
        worst, total = max(worst, ms), total + ms
        print(json.dumps({"problem": item.problem.short(), "first_call_ms": round(ms, 2)}), flush=True)
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
        with open(args.profile, "w") as f:
            f.write(text.getvalue())
    after = kernels.stats()
    moved = {k: after[k] - before.get(k, 0) for k in ("tunes", "benchmarks", "compiles", "artifact_loads",
                                                       "disk_hits", "store_hits", "store_errors") if k in after}
    print(json.dumps({"summary": True, "problems": len(listed), "worst_first_call_ms": round(worst, 2),
                      "total_first_calls_ms": round(total, 1), "process_s": round(time.perf_counter() - start, 2),
                      "stats": moved, "fastpath": kernels.fastpath_status()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
