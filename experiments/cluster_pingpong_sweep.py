"""Do CUTLASS ping-pong kernels with a 2-CTA cluster hold up better under sustained load than the ones we build (issue
27: int8 >= 1.8x `torch._int_mm`, bf16 geomean >= 1.05x `torch.mm`)?

Under the power cap a kernel that moves less data per MMA loses less clock. The sm90 pool's ping-pong tiles run
without a cluster except 64x128 (kernels.space.heuristics_cutlass._sm90_pool); a 2x1 or 1x2 cluster multicasts one
operand's tile over TMA to both CTAs, so each reads a third less from L2 per MMA. For each problem this builds (one
ninja batch) the ping-pong tiles 128x128 (swizzle 1 and 8) and 64x256 with clusters 1x1, 2x1 and 1x2 and the
cooperative 128x256 2x1 and 256x128 1x2 tiles, then loops each and aten in 1.5 s back-to-back loops (the last second
timed), alternated, 2 rounds, after 1 s of aten, as bench.sustained does: each one's ratio to aten there.
`python -m experiments.cluster_pingpong_sweep [--seconds 1.5] [--rounds 2] > out.jsonl` (GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace

import torch

from backends.cutlass import CutlassBackend
from bench.measure import problem_for
from bench.shapes import Shape
from bench.sustained import alternate, parse_problem
from kernels.core.choice import Choice
from kernels.dispatch.dynamic import build_launch
from kernels.measure.timing import user_call
from kernels.measure.verify import make_inputs, timing_sets
from kernels.space import heuristics_cutlass as hc

PROBLEMS = ("int8:1024x22016x4096:nt", "int8:4096x4096x4096:nt", "bf16:8192x8192x8192:nn",
            "bf16:4096x11008x4096:nt", "bf16:8192x14336x4096:nt")
# (tile_m, tile_n, cluster_m, cluster_n, schedule, swizzle): 128x128 ping-pong with swizzle 1 and 8 (the int8 picks
# were both, by problem; a run-time argument, one binary)
CONFIGS = [(128, 128, cm, cn, "pingpong", sw) for cm, cn in ((1, 1), (2, 1), (1, 2)) for sw in (1, 8)] + \
          [(64, 256, cm, cn, "pingpong", 1) for cm, cn in ((1, 1), (2, 1), (1, 2))] + \
          [(128, 256, 2, 1, "coop", 1), (256, 128, 1, 2, "coop", 1)]


def configs_for(problem) -> list[Choice]:
    """The CONFIGS as this problem's CUTLASS choices (16-byte accesses, swizzle 1), those the problem supports."""
    template = hc.templates_for(problem.op)[0]
    k = 128 if problem.op in hc.EIGHT_BIT_OPS else 64
    out = []
    for tm, tn, cm, cn, schedule, swizzle in CONFIGS:
        cfg = hc.fit_alignment(problem, template, hc.CutlassConfig(tm, tn, k, cm, cn, schedule, swizzle=swizzle))
        ok, why = hc.supports_cutlass(problem, template, cfg)
        if ok:
            out.append(Choice("cutlass", template, problem.dtype, None, cfg.params()))
        else:
            print(json.dumps({"unsupported": cfg.tag(), "problem": problem.short(), "why": why}), file=sys.stderr)
    return out


def aten_choice(problem) -> Choice:
    return Choice("aten", "aten_int_mm" if problem.op == "int_mm" else "aten_mm", problem.dtype)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", default=",".join(PROBLEMS), help="comma list of dtype:MxNxK:layout")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    specs = [parse_problem(t) for t in args.problems.split(",")]
    problems = [problem_for(Shape(s.m, s.n, s.k), s.dtype, s.layout, "cuda") for s in specs]
    work = [(pr, configs_for(pr)) for pr in problems]
    t0 = time.perf_counter()
    built = CutlassBackend().prebuild(work)
    print(json.dumps({"built": built, "build_s": round(time.perf_counter() - t0, 1)}), flush=True)
    for spec, (problem, choices) in zip(specs, work):
        a, b = make_inputs(problem, "cuda", seed=1)[:2]
        sets = timing_sets(problem, "cuda", (a, b), seed=2)
        calls, failures = {}, {}
        for choice in [aten_choice(problem), *choices]:
            launch, why = build_launch(problem, choice)
            if launch is None:
                failures[choice.name] = why
                continue
            calls[choice.name] = user_call(launch, sets)
            calls[choice.name](0)
        torch.cuda.synchronize()
        aten = aten_choice(problem).name
        alternate({aten: calls[aten]}, len(sets), 1, 1.0)          # heat: the first loop is not a cool chip's
        loops = alternate(calls, len(sets), args.rounds, args.seconds)
        base = statistics.median(loops[aten])
        rows = sorted(({"name": n, "loop_ratio": round(statistics.median(v) / base, 4),
                        "loop_ms": [round(x, 5) for x in v]} for n, v in loops.items() if n != aten),
                      key=lambda r: r["loop_ratio"])
        print(json.dumps({"problem": spec.label(), "aten_ms": [round(x, 5) for x in loops[aten]], "rows": rows,
                          "failures": failures}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
