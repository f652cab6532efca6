"""What the final round's power-steady regime needs (issue 27): how long until clocks settle, and whether alternated
short windows rank finalists as a 3 s loop does.

Showed (H100, 2026-11-25, docs/measurements/steady_regime_h100_fifteenth.json): the card hits its 700 W cap ~0.8 s
into a load and then holds 1200-1470 MHz (1980 before); aten's 4096x11008x4096 went 0.48 -> 0.56 ms per call. In 3 s
loops aten beat every Triton finalist on all four large problems (0.94-0.99x), though in 40 ms bursts the tiles led
on 4096x11008x4096 (1.015-1.032x). After a heat-up, 25 ms windows gave aten's smallest spread against itself
(0.0-1.2%) and the best tile's ratio to aten on the loop's side every time; 50-200 ms windows caught the cap's
periodic dips (aten's own windows 4-17% apart). Sized the steady round's first plan (25 ms windows); the
duel that replaced it (twenty-second session) was sized by experiments/duel_regime.py.

Per problem: tune with the given backends, take the first pass's fastest few and aten, then
  1. settle: after an idle pause, aten back to back for 4 s, ms per call in 50 ms slices;
  2. reference: each finalist in a 3 s back-to-back loop (mean of its last second), alternated, twice;
  3. the tuner's old final round (measure_together, 40 ms a finalist) and the steady regime (kernels.measure.steady)
     at several heat-ups and window lengths, each started after an idle pause, as a new problem's tune would be.
`python -m experiments.steady_regime --json out.json` (GPU). Prints one JSON line per problem.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kernels.core.problem import GemmProblem
from kernels.dispatch.dynamic import build_launch
from kernels.measure.steady import CudaWindows, SteadyPlan, measure_steady
from kernels.measure.timing import measure_together, user_call
from kernels.measure.verify import make_inputs, timing_sets
from kernels.tune.autotune import tune

PROBLEMS = [("4096x11008x4096", "nt"), ("6144x6144x6144", "nn"), ("4096x4096x4096", "nn"),
            ("8192x14336x4096", "nt"), ("32x32x32768", "nn")]


def _problem(shape: str, layout: str) -> GemmProblem:
    m, n, k = map(int, shape.split("x"))
    a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).t() if layout == "nt" else \
        torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
    return GemmProblem.from_tensors("mm", a, b)


def _loop_ms(call, n_sets: int, seconds: float, tail: float = 1.0) -> float:
    """A user's loop: `seconds` back to back, ms per call over the last `tail` seconds."""
    i = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds - tail:
        call(i % n_sets)
        i += 1
        if i % 64 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    c = 0
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < tail:
        call(i % n_sets)
        i += 1
        c += 1
        if c % 64 == 0:
            torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / c


def _settle_curve(call, n_sets: int, est_ms: float, seconds: float = 4.0, slice_ms: float = 50.0) -> list[float]:
    per = max(1, int(slice_ms / est_ms))
    events = []
    i = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(per):
            call(i % n_sets)
            i += 1
        e.record()
        events.append((s, e))
        if len(events) % 4 == 0:
            events[-4][1].synchronize()         # keep the host within a few slices of the GPU
    torch.cuda.synchronize()
    return [round(s.elapsed_time(e) / per, 5) for s, e in events]


def _rank(ms: dict[str, float]) -> list[str]:
    return sorted(ms, key=ms.get)


def run(shape: str, layout: str, backends: tuple[str, ...], finalists: int, idle_s: float) -> dict:
    problem = _problem(shape, layout)
    t0 = time.perf_counter()
    sel, _ = tune(problem, backends, verify_all=True)   # its finalists run here again
    tune_s = time.perf_counter() - t0
    ranked = sorted((t, n) for n, t in sel.timings.items() if isinstance(t, float))
    aten = next(n for _, n in ranked if n.startswith("aten"))
    names = [n for _, n in ranked[:finalists]]
    if aten not in names:
        names.append(aten)
    launches = {}
    for n in names:
        launch, err = build_launch(problem, sel.choices[n])
        if launch is not None:
            launches[n] = launch
    a, b = make_inputs(problem, "cuda", seed=1)
    sets = timing_sets(problem, "cuda", (a, b), seed=2)
    calls = {n: user_call(fn, sets) for n, fn in launches.items()}
    est = {n: sel.timings[n] for n in calls}
    out = {"shape": shape, "layout": layout, "winner": sel.winner, "tune_s": round(tune_s, 2), "n_sets": len(sets),
           "first_pass_ms": est}
    time.sleep(idle_s)
    out["settle_aten"] = _settle_curve(calls[aten], len(sets), est[aten])
    best = names[0] if names[0] != aten else (names[1] if len(names) > 1 else aten)
    out["settle_best"] = {best: _settle_curve(calls[best], len(sets), est[best], seconds=2.0)}
    ref: dict[str, list[float]] = {n: [] for n in calls}
    for rep in range(2):
        for n in (list(calls) if rep == 0 else list(calls)[::-1]):
            ref[n].append(_loop_ms(calls[n], len(sets), 3.0))
    out["loop3s_ms"] = ref
    ref_ms = {n: min(v) for n, v in ref.items()}
    out["loop3s_rank"] = _rank(ref_ms)
    time.sleep(idle_s)
    burst = measure_together(calls, len(sets), "cuda", 40.0 * len(calls))
    out["burst_ms"] = {n: t.median_ms for n, t in burst.items()}
    out["burst_rank"] = _rank(out["burst_ms"])
    regimes = []
    for heat in (0.0, 500.0, 1500.0):
        for window in (25.0, 50.0, 100.0, 200.0):
            time.sleep(idle_s)
            plan = SteadyPlan(heat_ms=heat, window_ms=window, rounds=3)
            res = measure_steady(CudaWindows(calls, len(sets)), est, aten, plan)
            ms = {n: t.median_ms for n, t in res.timings.items()}
            err = {n: round(ms[n] / ref_ms[n] - 1, 4) for n in ms}
            # does the regime's ratio to aten predict the loop's?
            ratio_err = {n: round((ms[n] / ms[aten]) / (ref_ms[n] / ref_ms[aten]) - 1, 4) for n in ms}
            regimes.append({"heat_ms": heat, "window_ms": window, "seconds": round(res.seconds, 3),
                            "ms": ms, "rank": _rank(ms), "rank_matches": _rank(ms) == out["loop3s_rank"],
                            "vs_loop": err, "ratio_vs_loop": ratio_err, "self_spread": round(res.self_spread, 4),
                            "windows": {n: t.windows_ms for n, t in res.timings.items()}})
    out["regimes"] = regimes
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--backends", default="aten,triton")
    p.add_argument("--finalists", type=int, default=4)
    p.add_argument("--idle", type=float, default=2.0, help="seconds idle before each regime (a new problem's tune)")
    p.add_argument("--problems", default=None, help="comma list of MxNxK:layout")
    args = p.parse_args(argv)
    problems = PROBLEMS if not args.problems else [tuple(x.split(":")) for x in args.problems.split(",")]
    rows = []
    for shape, layout in problems:
        row = run(shape, layout, tuple(args.backends.split(",")), args.finalists, args.idle)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
