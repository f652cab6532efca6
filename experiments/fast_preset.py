"""Showed KERNELS_PRESET=fast within issue 6's targets on the held-out problems (H100, same-run geomean / worst bf16
0.933 / 1.030, int8 0.902 / 1.231; `bash bench/gpu_check.sh fast`).

Issue 6 end to end on a GPU: tune problems with KERNELS_PRESET=fast (exhaustive search space, only the performance
model's top 5 per backend built and timed, aten beside them) and compare each winner's time with the best of every
candidate timed for the same problem in a dataset collected on this GPU (`python -m tools.perf_model collect`). Then a
new shape whose binaries are already built (same N, K; another M) is tuned and timed.

    python -m experiments.fast_preset --data tools/perf_model/data/h100_heldout_bf16.csv tools/perf_model/data/h100_heldout_int8.csv --json out.json

With the full-exhaustive files (`tools/perf_model/data/h100_heldout_full_{bf16,int8}.csv.gz`) the dataset's best is the full
exhaustive benchmark's winner.

The dataset's times come from another process (and an older launch path), so each winner is also timed side by
side with the dataset's best choice, built now, in this run ("same_run"): that ratio is the one to judge by. Where
both are one-launch calls under 0.1 ms their GPU times are compared too ("gpu_ratio"): call times that short are set
by the host. Datasets with GPU times (`model relabel`) rank those problems' candidates by them
(kernels.perf_data.gpu_labelled).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import torch

import kernels
from backends import get_backend
from kernels.core import counters
from kernels.core.config import config
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.core.selection import ROUND_KEYS
from kernels.measure.timing import device_time_ms, measure_together, user_call
from kernels.measure.verify import make_inputs, reference, timing_sets, verify_launch
from kernels.space import ranking
from kernels.space.families import one_launch
from kernels.space.ranking import model_for
from kernels.tune import candidates
from kernels.tune.autotune import tune
from kernels.tune.final_round import HOST_BOUND_MAX_MS
from tools.perf_model.data import gpu_labelled, read_dataset


def _reference(paths: list[str]) -> dict[tuple, dict]:
    """(op, dtype, m, n, k) -> {'best_ms', 'best', 'best_choice', 'candidates', 'label'} over every timed row (aten
    included). Problems with GPU times (`model relabel`) are ranked by them (label 'gpu'), others by call time."""

    rows, _ = read_dataset(paths)
    gpu = torch.cuda.get_device_name()
    ref: dict[tuple, dict] = {}
    for r in gpu_labelled([r for r in rows if r.gpu == gpu], keep_unlabelled=True):
        if r.ms is None:
            continue
        p = r.problem
        key = (p.op, p.dtype, p.m, p.n, p.k)
        entry = ref.setdefault(key, {"best_ms": math.inf, "best": "", "best_choice": None, "candidates": 0,
                                     "label": "call"})
        entry["candidates"] += 1
        if r.gpu_ms is not None:
            entry["label"] = "gpu"
        if r.ms < entry["best_ms"]:
            entry["best_ms"], entry["best"], entry["best_choice"] = r.ms, r.choice.name, r.choice
    return ref


def _side_by_side(problem, fast_runner, best_choice) -> dict:
    """The fast preset's winner and the dataset's best choice (built now, verified) timed together in this process,
    the way tuning re-times its finalists: the ratio without another run's clocks and host in it."""

    if best_choice.name == fast_runner.choice.name:
        return {"fast_ms": None, "best_ms": None, "ratio": 1.0, "gpu_ratio": 1.0, "note": "same choice"}
    if any(get_backend(c.backend).isolated for c in (best_choice, fast_runner.choice)):
        return {"error": "a choice of an isolated backend (CUTLASS) runs only in a child process"}
    (outcome,) = get_backend(best_choice.backend).build(problem, [best_choice])
    if outcome.runner is None:
        return {"error": f"dataset best did not build: {outcome.error}"}
    device = "cuda" if problem.device == "cuda" else "cpu"
    a, b = make_inputs(problem, device, seed=1)
    why = verify_launch(outcome.runner.launch, problem, (a, b), reference(problem, a, b))
    if why is not None:
        return {"error": f"dataset best failed verification: {why}"}
    fast, best = timed_together(problem, (a, b), fast_runner.launch, outcome.runner.launch,
                                2 * config.bench_budget_ms)
    row = {"fast_ms": fast, "best_ms": best, "ratio": fast / best}
    if device == "cuda" and one_launch(fast_runner.choice) and one_launch(best_choice) \
            and min(fast, best) < HOST_BOUND_MAX_MS:
        # calls this short are host-set, and two one-launch calls cost the host the same: their kernels' own times
        # rank them (kernels.perf_data.gpu_labelled's rule; a second launch's host cost shows only in call time)
        fast_gpu, best_gpu = gpu_times(problem, (a, b), fast_runner.launch, outcome.runner.launch)
        if fast_gpu and best_gpu:
            row.update(fast_gpu_ms=fast_gpu, best_gpu_ms=best_gpu, gpu_ratio=fast_gpu / best_gpu)
    return row


def gpu_times(problem, first: tuple, launch_a, launch_b) -> tuple[float | None, float | None]:
    """GPU ms per call of two launches (kernels.timing.device_time_ms) over the rotated input sets."""

    sets = timing_sets(problem, "cuda", first, seed=2)
    return (device_time_ms(user_call(launch_a, sets), len(sets)),
            device_time_ms(user_call(launch_b, sets), len(sets)))


def timed_together(problem, first: tuple, launch_a, launch_b, budget_ms: float) -> tuple[float, float]:
    """Median ms per user call of two launches re-timed side by side (measure_together, tuning's final round) over
    the rotated input sets that start with `first`."""

    device = "cuda" if problem.device == "cuda" else "cpu"
    sets = timing_sets(problem, device, first, seed=2)
    timed = measure_together({"a": user_call(launch_a, sets), "b": user_call(launch_b, sets)}, len(sets), device,
                             budget_ms)
    return timed["a"].median_ms, timed["b"].median_ms


def summarize(rows: list[dict]) -> dict:
    """Per dtype: the winners against the dataset (and side by side in this run), timings saved, and the new-shape
    tunes split by whether their picks were built already (the issue's "warm binaries") or needed compiles."""
    summary = {}
    for dtype in sorted({r["problem"][1] for r in rows if "ratio" in r}):
        ok = [r for r in rows if "ratio" in r and r["problem"][1] == dtype]
        ratios = [r["ratio"] for r in ok]
        same = [r["same_run"]["ratio"] for r in ok if "ratio" in r.get("same_run", {})]
        # one-launch calls under HOST_BOUND_MAX_MS by GPU time (_side_by_side), others by call time
        judged = [r["same_run"].get("gpu_ratio", r["same_run"]["ratio"]) for r in ok
                  if "ratio" in r.get("same_run", {})]
        warm = sorted(r["new_shape"]["seconds"] for r in ok if r["new_shape"]["compiles"] == 0)
        compiled = sorted(r["new_shape"]["seconds"] for r in ok if r["new_shape"]["compiles"] > 0)
        summary[dtype] = {"problems": len(ok), "geomean": _geomean(ratios), "worst": max(ratios),
                          "same_run_problems": len(same), "same_run_geomean": _geomean(same),
                          "same_run_worst": max(same, default=math.nan),
                          "gpu_time_problems": sum("gpu_ratio" in r.get("same_run", {}) for r in ok),
                          "judged_geomean": _geomean(judged), "judged_worst": max(judged, default=math.nan),
                          "timed_fast": sum(r["fast_benchmarks"] for r in ok),
                          "timed_dataset": sum(r["dataset_candidates"] for r in ok),
                          "new_shape_warm": len(warm),
                          "new_shape_warm_median_s": warm[len(warm) // 2] if warm else math.nan,
                          "new_shape_warm_max_s": warm[-1] if warm else math.nan,
                          "new_shape_compiled": len(compiled),
                          "new_shape_compiled_max_s": compiled[-1] if compiled else math.nan}
    return summary


def _geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else math.nan


def cuda_problem(op: str, dtype: str, m: int, n: int, k: int):
    """The GemmProblem of row-major (m, k) x (k, n) operands of `dtype` on this GPU."""

    t = DTYPES_BY_NAME[dtype]
    a = torch.empty(m, k, device="cuda", dtype=t)
    b = torch.empty(k, n, device="cuda", dtype=t)
    return GemmProblem.from_tensors(op, a, b)


def tuned(problem, backends, verify_all: bool = False) -> dict:
    """Tune `problem` under the current config: winner, its time, seconds, compiles and benchmarks it cost, notes;
    plus "runner" and "selection" (objects, for the caller to use and pop before writing JSON). `verify_all`: every
    timed candidate verified (a dataset's labels are then all checked)."""

    before = counters.snapshot()
    t0 = time.perf_counter()
    sel, runners = tune(problem, backends, verify_all=verify_all)
    seconds = time.perf_counter() - t0
    after = counters.snapshot()
    return {"winner": sel.winner, "ms": sel.timings[sel.winner], "seconds": seconds,
            "compiles": after["compiles"] - before["compiles"],
            "benchmarks": after["benchmarks"] - before["benchmarks"], "notes": list(sel.notes),
            "stages": dict(sel.stage_seconds), "finalists": finalists(sel),
            "timed": {n: t for n, t in sel.timings.items() if isinstance(t, float)},
            "runner": runners[sel.winner], "selection": sel}


def finalists(sel) -> dict[str, dict]:
    """The final round's first-pass, re-timed and GPU times per finalist (ms): what a surprising pick is read by."""
    return {n: {k: d[k] for k in ROUND_KEYS if k in d} for n, d in sel.details.items() if "final_ms" in d}


def _ranking() -> dict:
    """How the top k were ranked in this run (the settings a later reader cannot see in the rows)."""
    return {"ensemble": ranking.ENSEMBLE_PICKS, "analytic_share": ranking.ANALYTIC_SHARE,
            "analytic_share_by_dtype": ranking.ANALYTIC_SHARE_BY_DTYPE,
            "hedge_families": ranking.HEDGE_FAMILIES, "hedge_ratio": ranking.HEDGE_RATIO,
            "warm_tie": candidates.WARM_TIE}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="dataset CSV(s) collected on this GPU")
    ap.add_argument("--backends", default="aten,triton")
    ap.add_argument("--limit", type=int, default=0, help="only the first N problems per dtype")
    ap.add_argument("--time-limit-s", type=float, default=400.0, help="start no new problem after this")
    ap.add_argument("--json")
    ap.add_argument("--perf-model", help="what ranks the candidates: auto (default), analytic, learned, or a learned "
                                         "model's .json (to compare a new model)")
    args = ap.parse_args(argv)

    os.environ["KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernels_fast_")
    kernels.config.preset = "fast"
    if args.perf_model:
        kernels.config.perf_model = args.perf_model
    backends = tuple(args.backends.split(","))
    ref = _reference(args.data)
    start = time.perf_counter()
    rows, per_dtype = [], {}
    for key in sorted(ref, key=lambda k: (k[2] * k[3] * k[4], k[1])):      # both dtypes progress together
        op, dtype, m, n, k = key
        if args.limit and per_dtype.get(dtype, 0) >= args.limit:
            continue
        if time.perf_counter() - start > args.time_limit_s:
            break
        per_dtype[dtype] = per_dtype.get(dtype, 0) + 1
        problem = cuda_problem(op, dtype, m, n, k)
        model, why = model_for(problem)
        try:
            fast = tuned(problem, backends)
        except Exception as e:  # noqa: BLE001 - one failing problem is a row, not the end of the run
            rows.append({"problem": list(key), "error": f"{type(e).__name__}: {e}"})
            continue
        runner = fast.pop("runner")
        fast.pop("selection")
        row = {"problem": list(key), "model": model.name, "model_note": why, **{f"fast_{k2}": v for k2, v in
               fast.items()}, "dataset_best_ms": ref[key]["best_ms"], "dataset_best": ref[key]["best"],
               "dataset_candidates": ref[key]["candidates"], "ratio": fast["ms"] / ref[key]["best_ms"]}
        try:
            row["same_run"] = _side_by_side(problem, runner, ref[key]["best_choice"])
        except Exception as e:  # noqa: BLE001 - the side-by-side is a second opinion, not the row
            row["same_run"] = {"error": f"{type(e).__name__}: {e}"}
        # another M with the same N, K: its binaries are the ones just built (M is a runtime argument)
        new_shape = tuned(cuda_problem(op, dtype, m + 16, n, k), backends)
        new_shape.pop("runner")
        new_shape.pop("selection")
        row["new_shape"] = new_shape
        rows.append(row)
        same = row["same_run"]
        same_text = f"same run {same['ratio']:.3f}x" if "ratio" in same else f"same run: {same['error'][:80]}"
        if "gpu_ratio" in same:
            same_text += f", GPU time {same['gpu_ratio']:.3f}x"
        gpu_label = " (GPU-time label)" if ref[key]["label"] == "gpu" else ""
        print(f"{op} {dtype} {m}x{n}x{k}: fast {fast['winner']} {fast['ms'] * 1e3:.1f} us vs dataset best "
              f"{ref[key]['best']} {ref[key]['best_ms'] * 1e3:.1f} us{gpu_label} = {row['ratio']:.3f}x ({same_text}); "
              f"{fast['compiles']} compiles, {fast['benchmarks']} timed of {ref[key]['candidates']}, "
              f"{fast['seconds']:.1f} s; M+16 {new_shape['seconds']:.2f} s ({new_shape['compiles']} compiles; "
              f"{', '.join(f'{k} {v:.2f}' for k, v in new_shape['stages'].items())})",
              flush=True)
    summary = summarize(rows)
    for dtype, s in summary.items():
        print(f"{dtype}: {s['problems']} problems, fast-preset winner vs dataset best geomean {s['geomean']:.3f}x "
              f"worst {s['worst']:.3f}x (timed side by side in this run, {s['same_run_problems']} problems: "
              f"{s['same_run_geomean']:.3f}x / {s['same_run_worst']:.3f}x; by GPU time where both are one-launch "
              f"calls under {HOST_BOUND_MAX_MS * 1e3:.0f} us ({s['gpu_time_problems']} problems): "
              f"{s['judged_geomean']:.3f}x / {s['judged_worst']:.3f}x); "
              f"{s['timed_dataset'] / max(s['timed_fast'], 1):.1f}x fewer timed; new shape with every pick built "
              f"({s['new_shape_warm']} problems) median {s['new_shape_warm_median_s']:.2f} s, max "
              f"{s['new_shape_warm_max_s']:.2f} s; where the new shape's picks needed compiles "
              f"({s['new_shape_compiled']}) max {s['new_shape_compiled_max_s']:.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ranking": _ranking(),
                       "rows": rows, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
