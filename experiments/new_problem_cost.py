"""What a new problem costs when its binaries are already built (issue 27: a new large problem <= 3 s): the first
call of each problem of a bench.sustained set, in this process, against a cache that holds the kernels but no
selection for them (run it after `python -m kernels warmup` and a run that built the rest, with the cache's
`selections/` removed). Prints one JSON line per problem: wall seconds of the first call, the tune's stages, whether
anything compiled, the duel's windows, the verified candidates and how many were timed but never verified.
`python -m experiments.new_problem_cost [--set issue27] [--closing-window always] [--duel calls|loop]` (GPU); `always`
runs every duel's closing window as before the first-window bound (the eight-percent stop only), to compare the two in
one call. With the duel on calls (the default), the problem is then called back to back until its verdict is in:
`duel_calls_s` and `duel_calls` are what that took, `winner` the verdict.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import kernels
from bench.measure import problem_for
from bench.shapes import Shape
from bench.sustained import problem_set
from kernels.core.selection import NOT_VERIFIED
from kernels.measure.verify import make_inputs
from kernels.tune import final_round


DUEL_LIMIT_S = 30.0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="issue27")
    p.add_argument("--closing-window", choices=("when-needed", "always"), default="when-needed")
    p.add_argument("--duel", choices=("calls", "loop"), default=None, help="KERNELS_DUEL for this run")
    args = p.parse_args(argv)
    if args.duel is not None:
        kernels.config.duel = args.duel
    if args.closing_window == "always":
        final_round._hopeless = final_round._far_behind
    for spec in problem_set(args.set):
        problem = problem_for(Shape(spec.m, spec.n, spec.k), spec.dtype, spec.layout, "cuda")
        a, b = make_inputs(problem, "cuda", seed=0)
        fn = kernels.int_mm if spec.op == "int_mm" else kernels.mm
        before = kernels.stats()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(a, b)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        after = kernels.stats()
        first = kernels.explain(a, b, op=spec.op)
        calls, t1, slowest = 0, time.perf_counter(), 0.0
        while first.awaiting_calls and kernels.stats()["duels_pending"] and time.perf_counter() - t1 < DUEL_LIMIT_S:
            for _ in range(20):         # back to back between checks, as a user's loop
                t2 = time.perf_counter()
                fn(a, b)
                slowest = max(slowest, time.perf_counter() - t2)      # host time: a call that waited (a join)
            calls += 20
        torch.cuda.synchronize()
        duel_s = time.perf_counter() - t1
        sel = kernels.explain(a, b, op=spec.op)
        duel = {n: d["final_windows_ms"] for n, d in sel.details.items() if "final_windows_ms" in d}
        print(json.dumps({"problem": spec.label(), "closing_window": args.closing_window,
                          "first_call_s": round(seconds, 3), "winner": sel.winner, "duel_windows_ms": duel,
                          "duel_on_calls": first.duel, "unmeasured_on_calls": len(first.unmeasured),
                          "duel_calls": calls, "duel_calls_s": round(duel_s, 3) if first.awaiting_calls else None,
                          "slowest_call_s": round(slowest, 3),
                          "notes": sel.notes[-1:],
                          "regime": sel.regime, "source": sel.source, "stages": sel.stage_seconds,
                          "compiles": after.get("compiles", 0) - before.get("compiles", 0),
                          "tunes": after["tunes"] - before["tunes"], "pending": list(sel.pending),
                          "verified": sorted(n for n, t in sel.timings.items() if isinstance(t, float)),
                          "unverified": sum(isinstance(t, str) and t.startswith(NOT_VERIFIED)
                                            for t in sel.timings.values())}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
