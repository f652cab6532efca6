"""Showed that host-bound first passes are host jitter (int8 64x64x65536: 13.5-16.5 us per call for a 10.6 us tile),
which led to the wider host-bound final round (tenth session).

How tuning ranked each problem's candidates, tune after tune: the AUTOTUNE table with every finalist's first-pass,
re-timed (final round) and GPU times (`Selection.table(rounds=True)`). For small (host-bound) problems, whose first
passes are host jitter.

    python -m experiments.host_bound_diag --problems int8:64x64x65536,int8:24x6144x1536 --repeats 3 --preset fast

Each tune starts from an empty cache (nothing selected, every pick compiled again).
"""
from __future__ import annotations

import argparse
import tempfile

import torch

from experiments.exhaustive_reference import parse_problems
from experiments.fast_preset import cuda_problem
from kernels.core.config import config
from kernels.tune.autotune import tune


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=parse_problems, required=True, help="DTYPE:MxNxK,... (bf16, fp16, int8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--preset", default="fast")
    ap.add_argument("--backends", default="aten,triton")
    args = ap.parse_args(argv)


    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (host-bound timing is what it looks at)")
    for rep in range(args.repeats):
        for op, dtype, m, n, k in args.problems:
            config._overrides.clear()
            config.cache_dir = tempfile.mkdtemp(prefix="kernels_diag_")
            config.preset = args.preset
            sel, _ = tune(cuda_problem(op, dtype, m, n, k), tuple(args.backends.split(",")))
            print(f"tune {rep + 1}:", sel.table(rounds=True), sep="\n", flush=True)
    config._overrides.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
