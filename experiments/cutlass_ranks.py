"""Where each CUTLASS candidate of the default set stands (issue 27's warmup: which of the set's binaries ever
contend): every problem of kernels.tune.warmup's default set for a dtype is tuned (the set built beforehand by
`python -m kernels warmup`), and for each CUTLASS candidate its first-pass time is printed against the fastest
candidate's and the fastest CUTLASS one's. One JSON line per problem, then a summary per config.
`python -m experiments.cutlass_ranks [--dtype bf16]` (GPU).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

import kernels
from kernels.core.selection import NOT_VERIFIED
from kernels.measure.verify import make_inputs
from kernels.tune.warmup import default_problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args(argv)
    major, minor = torch.cuda.get_device_capability()
    by_config: dict[str, list[float]] = defaultdict(list)
    for problem in default_problems(major * 10 + minor, args.dtype, torch.cuda.get_device_name()):
        a, b = make_inputs(problem, "cuda", seed=0)[:2]
        (kernels.int_mm if problem.op == "int_mm" else kernels.mm)(a, b)
        torch.cuda.synchronize()
        sel = kernels.explain(a, b, op=problem.op)
        times = sel.first_pass()
        best = min(times.values())
        cutlass = {n: t for n, t in times.items() if n.startswith("cutlass")}
        best_cutlass = min(cutlass.values()) if cutlass else None
        failed = {n: t[:160] for n, t in sel.timings.items() if n.startswith("cutlass") and isinstance(t, str)
                  and not t.startswith(("unsupported", "left out", NOT_VERIFIED))}
        row = {"problem": problem.short(), "winner": sel.winner, "best": min(times, key=times.get),
               "best_ms": best, "best_cutlass_ms": best_cutlass, "cutlass_failed": failed,
               "cutlass": {n: round(t / best, 4) for n, t in sorted(cutlass.items(), key=lambda x: x[1])}}
        print(json.dumps(row), flush=True)
        for name, t in cutlass.items():
            by_config[name.split("_sw")[0]].append(t / best)
    for config, ratios in sorted(by_config.items(), key=lambda x: min(x[1])):
        print(json.dumps({"config": config, "problems": len(ratios), "best_ratio": round(min(ratios), 4),
                          "within_5pct": sum(r <= 1.05 for r in ratios)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
