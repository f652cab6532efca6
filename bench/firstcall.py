"""Child process for bench.core_slice: time the first kernels.mm call of each shape in a fresh process.

    python -m bench.firstcall --cache-dir DIR --backends aten,triton --dtype bf16 --shape 1536,4096,4096 ...

Prints one JSON object: per shape the first call's wall time (tensors already on the device, so CUDA context setup
is not counted in it; `since_import_s` counts everything after `import torch, kernels`), and kernels.stats().
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _shape(text: str) -> tuple[int, int, int]:
    try:
        m, n, k = (int(v) for v in text.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--shape wants M,N,K, got {text!r}") from e
    return m, n, k


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.firstcall")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--backends", default="aten,triton")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--shape", type=_shape, action="append", required=True)
    args = p.parse_args(argv)
    # before kernels reads them (config is lazy, but the child must not depend on that)
    os.environ["KERNELS_CACHE_DIR"] = args.cache_dir
    os.environ["KERNELS_BACKENDS"] = args.backends

    import torch

    import kernels
    after_import = time.perf_counter()
    from bench.measure import first_call_source, op_for, problem_for
    from bench.shapes import Shape
    from kernels.verify import make_inputs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    entry = kernels.int_mm if op_for(args.dtype) == "int_mm" else kernels.mm
    results = []
    for m, n, k in args.shape:
        problem = problem_for(Shape(m, n, k), args.dtype, "nn", device)
        a, b = make_inputs(problem, device)
        if device == "cuda":
            torch.cuda.synchronize()
        before = kernels.stats()
        start = time.perf_counter()
        entry(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        end = time.perf_counter()
        after = kernels.stats()
        sel = kernels.explain(a, b, op=problem.op)
        results.append({"shape": [m, n, k], "first_call_s": end - start, "since_import_s": end - after_import,
                        "winner": sel.winner, "source": first_call_source(before, after),
                        "compiles": after["compiles"] - before["compiles"], "stats": after})
    json.dump({"device": device, "results": results}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
