"""How tuning ranked each problem's candidates, tune after tune: every timed choice's first-pass, re-timed (final
round) and GPU times, the winner and the notes. For small (host-bound) problems, whose first passes are host jitter.

    python -m bench.host_bound_diag --problems int8:64x64x65536,int8:24x6144x1536 --repeats 3 --preset fast

Each tune starts from an empty cache (nothing selected, every pick compiled again).
"""
from __future__ import annotations

import argparse
import tempfile


def report(sel) -> list[str]:
    """One line per timed choice (fastest first), then failures and notes."""
    timed = sorted((t, n) for n, t in sel.timings.items() if isinstance(t, float))
    lines = []
    for t, name in timed:
        d = sel.details.get(name, {})
        extra = "".join(f" {key} {d[key] * 1e3:.2f}" for key in ("first_pass_ms", "retimed_ms", "gpu_ms") if key in d)
        lines.append(f"   {name:55s} {t * 1e3:8.2f} us{extra}")
    lines += [f"   {name}: {why}" for name, why in sel.timings.items() if not isinstance(why, float)]
    return lines + [f"   note: {n}" for n in sel.notes]


def main(argv=None) -> int:
    from bench.exhaustive_reference import parse_problems

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=parse_problems, required=True, help="DTYPE:MxNxK,... (bf16, fp16, int8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--preset", default="fast")
    ap.add_argument("--backends", default="aten,triton")
    args = ap.parse_args(argv)
    import torch

    from bench.fast_preset import cuda_problem
    from kernels.autotune import tune
    from kernels.config import config

    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (host-bound timing is what it looks at)")
    for rep in range(args.repeats):
        for op, dtype, m, n, k in args.problems:
            config._overrides.clear()
            config.cache_dir = tempfile.mkdtemp(prefix="kernels_diag_")
            config.preset = args.preset
            sel, _ = tune(cuda_problem(op, dtype, m, n, k), tuple(args.backends.split(",")))
            print(f"tune {rep + 1} {dtype} {m}x{n}x{k}: winner {sel.winner}", *report(sel), sep="\n", flush=True)
    config._overrides.clear()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
