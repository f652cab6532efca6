"""Can long windows alone choose a large problem's winner (issue 27's cost: a new problem <= 3 s)?

Today's final round for calls >= 0.1 ms is a steady round of short windows (0.5 s heat-up, 8 rounds of 25 ms) and,
whenever a challenger comes within 10% of aten there or beats it by less than 40%, a confirmation in long windows
(2 rounds of 300 ms, half untimed): ~3.3 s of a 4.3 s new problem on the H200. The short windows flattered bf16
CUTLASS tiles by up to 16% there, so the long windows decide; the short ones only pick the challenger. This times,
right after each problem's tune (the chip as a tune leaves it):

- duels: aten against the first pass's fastest challenger in long windows (half of each untimed), 3 rounds, at
  several window lengths;
- a round of long windows over the first pass's fastest three and aten;
- the truth: every one of them in 1.5 s back-to-back loops (the last second timed), alternated, 2 rounds.

Per regime and per number of rounds (its first r), the ratio of each challenger to aten as the final round computes
it, aten's spread against itself, and the seconds spent; offline, which decision each would make against the loops'.
`python -m experiments.duel_regime [--set issue27] > out.jsonl` (GPU, the CUTLASS set built).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.measure import problem_for
from bench.shapes import Shape
from bench.sustained import alternate, problem_set
from kernels.core.config import config
from kernels.dispatch.dynamic import build_launch
from kernels.measure.steady import CudaWindows, SteadyPlan, measure_steady
from kernels.measure.timing import user_call
from kernels.measure.verify import make_inputs, timing_sets
from kernels.tune.autotune import tune

DUEL_WINDOWS_MS = (150.0, 300.0)
ALL_WINDOW_MS = 200.0
ROUNDS = 3


def _regime(calls, n_sets: int, est, aten, window_ms: float) -> dict:
    res = measure_steady(CudaWindows(calls, n_sets), {n: est[n] for n in calls}, aten,
                         SteadyPlan(heat_ms=0.0, window_ms=window_ms, rounds=ROUNDS, settle_fraction=0.5))
    return {"window_ms": window_ms, "seconds": round(res.seconds, 3), "self_spread": round(res.self_spread, 5),
            "ratios": {n: [round(r, 5) for r in t.ratios] for n, t in res.timings.items() if n != aten},
            "windows_ms": {n: [round(w, 6) for w in t.windows_ms] for n, t in res.timings.items()},
            "failures": res.failures}


def direct_calls(problem, sel, names: list[str], out: dict) -> tuple[dict, list]:
    """A call per name as the dispatcher would launch it, over rotating input sets (each run once); one that cannot
    be built is recorded in out["build_failures"]."""
    a, b = make_inputs(problem, "cuda", seed=1)[:2]
    sets = timing_sets(problem, "cuda", (a, b), seed=2)
    calls = {}
    for name in names:
        launch, why = build_launch(problem, sel.choices[name])
        if launch is None:
            out.setdefault("build_failures", {})[name] = why
            continue
        calls[name] = user_call(launch, sets)
        calls[name](0)
    torch.cuda.synchronize()
    return calls, sets


def run(spec, idle_s: float, order: int) -> dict:
    problem = problem_for(Shape(spec.m, spec.n, spec.k), spec.dtype, spec.layout, "cuda")
    t0 = time.perf_counter()
    sel, _ = tune(problem, config.backends, verify_all=True)   # its candidates run here again
    tune_s = time.perf_counter() - t0
    first = sel.first_pass()
    aten = next((n for n in sorted(first, key=first.get) if n.startswith("aten")), None)
    ranked = [n for n in sorted(first, key=first.get) if n != aten]
    out = {"problem": spec.label(), "winner": sel.winner, "tune_s": round(tune_s, 2), "notes": sel.notes,
           "stages": sel.stage_seconds, "first_pass_ms": {n: first[n] for n in ranked[:6] + [aten]}}
    calls, sets = direct_calls(problem, sel, [aten] + ranked[:3], out)
    challengers = [n for n in ranked[:3] if n in calls]
    out["challengers"] = challengers
    if not challengers:
        return out
    top = challengers[0]
    plans = [("duel", w, {aten: calls[aten], top: calls[top]}) for w in DUEL_WINDOWS_MS]
    plans.append(("all", ALL_WINDOW_MS, calls))
    plans = plans[order % len(plans):] + plans[:order % len(plans)]
    out["regimes"] = []
    for kind, window, subset in plans:
        time.sleep(idle_s)
        r = _regime(subset, len(sets), first, aten, window)
        r["kind"] = kind
        out["regimes"].append(r)
    time.sleep(idle_s)
    loops = alternate(calls, len(sets), 2, 1.5)
    out["loops_ms"] = loops
    out["loop_ratio"] = {n: round(statistics.median(v) / statistics.median(loops[aten]), 5)
                         for n, v in loops.items() if n != aten}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--set", default="issue27")
    p.add_argument("--idle", type=float, default=0.3, help="seconds idle before each regime")
    p.add_argument("--start", type=int, default=0, help="first problem of the set (0-based)")
    p.add_argument("--stop", type=int, default=None, help="the problem after the last")
    args = p.parse_args(argv)
    print_rows(list(enumerate(problem_set(args.set)))[args.start:args.stop], lambda i, spec: run(spec, args.idle, i))
    return 0


def print_rows(indexed_specs, run_one) -> None:
    """One JSON line per problem: run_one(index, spec)'s row, or the error that stopped it (the rest still run)."""
    for i, spec in indexed_specs:
        try:
            row = run_one(i, spec)
        except Exception as e:  # noqa: BLE001 - one problem's failure is a result; the rest still run
            row = {"problem": spec.label(), "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
