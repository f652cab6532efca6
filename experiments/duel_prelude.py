"""Does the duel read a challenger the same whatever ran before it? (issue 27: the final round for calls >= 0.1 ms)

The duel (kernels.measure.steady.measure_duel: aten B and the first pass's fastest challenger C in 300 ms windows,
half untimed, B C B C B ...) follows the first pass at once, so the chip's state when it starts is whatever the first
pass left. Twenty-sixth session, H100: with a first pass over 8 candidates instead of 28, the same Triton tiles read
0.97-1.02x aten in the duel instead of 1.09-1.19x. This times, per problem, right after its tune:

- the duel (3 rounds, no early stop; every window kept) after each prelude, each from 2 s idle:
  `cool` (nothing), `pass28` and `pass8` (a first pass as tuning runs it over aten and the first pass's fastest
  27 or 7 others), `heat` (1 s of aten back to back);
- with --long, the duel in 1 s windows (half untimed), B C B, after 1 s of aten (`long`);
- the truth: aten and C in 1.5 s back-to-back loops (the last second timed), alternated, 2 rounds, after 1 s of aten.

Preludes rotate per problem. From the windows, offline: C1/B1 (what the first-window stop reads), each round's
bracketed ratio C / mean(B before, B after), against the loops' ratio.
`python -m experiments.duel_prelude --problems bf16:4096x12288x4096:nt,... > out.jsonl` (GPU).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from bench.measure import problem_for
from bench.shapes import Shape
from bench.sustained import alternate, cuda_loop, parse_problems
from experiments.duel_regime import direct_calls, print_rows
from kernels.core.config import config
from kernels.measure.steady import WINDOW_MS, CudaWindows, measure_duel, plan_for
from kernels.measure.timing import QUICK_SCREEN, TUNE_CUTOFF, measure_interleaved
from kernels.tune.autotune import tune

PRELUDES = ("cool", "pass28", "pass8", "heat")
IDLE_S = 2.0


def sm_clock_mhz() -> int | None:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - needs pynvml; the clock is a side note
        return None


def prelude(kind: str, calls: dict, ranked: list[str], n_sets: int, aten: str) -> float:
    """Run the prelude; seconds it took."""
    t0 = time.perf_counter()
    if kind.startswith("pass"):
        names = ranked[:int(kind[4:])]
        measure_interleaved({n: calls[n] for n in names}, n_sets, "cuda", config.bench_budget_ms,
                            cutoff=TUNE_CUTOFF, screen=QUICK_SCREEN)
    elif kind == "heat":
        cuda_loop(calls[aten], n_sets, 1.0)()
    return time.perf_counter() - t0


def duel_row(calls: dict, n_sets: int, est: dict, aten: str, top: str, window_ms: float | None = None,
             rounds: int = 3) -> dict:
    plan = replace(plan_for("cuda"), window_ms=window_ms or WINDOW_MS, rounds=rounds)
    clock = sm_clock_mhz()
    res = measure_duel(CudaWindows({aten: calls[aten], top: calls[top]}, n_sets), est, aten, top, plan)
    b, c = res.timings[aten].windows_ms, res.timings[top].windows_ms
    return {"clock_mhz_at_start": clock, "B": [round(x, 6) for x in b], "C": [round(x, 6) for x in c],
            "C1/B1": round(c[0] / b[0], 5),
            "round_ratios": [round(c[i] / ((b[i] + b[i + 1]) / 2), 5) for i in range(min(len(c), len(b) - 1))],
            "aten_spread": [round(abs(b[i] - b[i + 1]) / ((b[i] + b[i + 1]) / 2), 5) for i in range(len(b) - 1)],
            "seconds": round(res.seconds, 3)}


def run(spec, order: int, preludes: tuple[str, ...], long: bool) -> dict:
    problem = problem_for(Shape(spec.m, spec.n, spec.k), spec.dtype, spec.layout, "cuda")
    t0 = time.perf_counter()
    sel, _ = tune(problem, config.backends, verify_all=True)   # its candidates run here again
    first = sel.first_pass()
    aten = next(n for n in sorted(first, key=first.get) if n.startswith("aten"))
    ranked = [n for n in sorted(first, key=first.get) if n != aten]
    out = {"problem": spec.label(), "winner": sel.winner, "tune_s": round(time.perf_counter() - t0, 2),
           "first_pass_ratio": {n: round(first[n] / first[aten], 4) for n in ranked[:8]}}
    calls, sets = direct_calls(problem, sel, [aten] + ranked[:28], out)
    ranked = [n for n in ranked if n in calls]
    if not ranked:
        return out
    top = ranked[0]
    out["challenger"] = top
    est = {aten: first[aten], top: first[top]}
    kinds = list(preludes[order % len(preludes):] + preludes[:order % len(preludes)])
    out["duels"] = {}
    for kind in kinds:
        time.sleep(IDLE_S)
        seconds = prelude(kind, calls, [aten] + ranked, len(sets), aten)
        row = duel_row(calls, len(sets), est, aten, top, window_ms=300.0)   # the windows the preludes were run with
        row["prelude_s"] = round(seconds, 3)
        out["duels"][kind] = row
    if long:
        time.sleep(IDLE_S)
        seconds = prelude("heat", calls, [aten] + ranked, len(sets), aten)
        row = duel_row(calls, len(sets), est, aten, top, window_ms=1000.0, rounds=1)
        row["prelude_s"] = round(seconds, 3)
        out["duels"]["long"] = row
    time.sleep(IDLE_S)
    cuda_loop(calls[aten], len(sets), 1.0)()
    loops = alternate({aten: calls[aten], top: calls[top]}, len(sets), 2, 1.5)
    out["loops_ms"] = loops
    out["loop_ratio"] = round(statistics.median(loops[top]) / statistics.median(loops[aten]), 5)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--problems", required=True, help="comma list of dtype:MxNxK[:layout]")
    p.add_argument("--preludes", default=",".join(PRELUDES), help=f"comma list of {', '.join(PRELUDES)}")
    p.add_argument("--long", action="store_true", help="also the duel in 1 s windows after 1 s of aten")
    args = p.parse_args(argv)
    preludes = tuple(x for x in args.preludes.split(",") if x)
    if not preludes or any(x not in PRELUDES for x in preludes):
        p.error(f"--preludes: a comma list of {', '.join(PRELUDES)}")
    print_rows(list(enumerate(parse_problems(args.problems))), lambda i, spec: run(spec, i, preludes, args.long))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
