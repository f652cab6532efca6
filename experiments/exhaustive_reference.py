"""Showed the fast preset 1.113-1.118x off the full exhaustive optimum on int8 4000x4000x320 (H100, ninth session;
`bash bench/gpu_check.sh exhaustive`).

Issue 6's reference done in full: the fast preset's winner against a full exhaustive benchmark (every candidate of
the exhaustive search space built and timed), in one process, the two winners then timed side by side three times.

    python -m experiments.exhaustive_reference --problems int8:4000x4000x320,bf16:96x22016x4096 --time-limit-s 250

A full exhaustive tune took 20-190 s per problem on the H100 (900-2,700 candidates). Where the full exhaustive timings
are already on file (`tools/perf_model/data/h100_heldout_full_*.csv.gz`, `bash bench/gpu_check.sh truth`), `experiments.fast_preset
--data` on those files makes the same comparison without tuning every candidate again.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from experiments.fast_preset import cuda_problem, timed_together, tuned
from kernels.core.config import config
from kernels.measure.verify import make_inputs
from tools.perf_model.data import append_rows, run_env, selection_rows


def parse_problems(text: str) -> list[tuple[str, str, int, int, int]]:
    """'int8:4000x4000x320,bf16:96x22016x4096' -> [(op, dtype, m, n, k), ...]."""
    out = []
    for item in text.split(","):
        dtype, _, shape = item.strip().partition(":")
        parts = shape.lower().split("x")
        if dtype not in ("bf16", "fp16", "int8") or len(parts) != 3 or not all(p.isdigit() and int(p) > 0
                                                                                  for p in parts):
            raise argparse.ArgumentTypeError(f"expected DTYPE:MxNxK (bf16, fp16 or int8), got {item!r}")
        out.append(("int_mm" if dtype == "int8" else "mm", dtype, *map(int, parts)))
    return out


def compare(problem, backends: tuple[str, ...], repeats: int = 3, budget_ms: float = 80.0,
            truth_csv: str | None = None) -> dict:
    """Tune `problem` with the fast preset, then with every exhaustive candidate; the winners' side-by-side ratios.
    `truth_csv`: every exhaustive candidate's timing is appended there (the dataset format of `model collect`), the
    offline ground truth `python -m kernels model eval` scores a model's top k against."""

    saved = dict(config._overrides)
    try:
        config._overrides.clear()
        config.preset = "fast"
        fast = tuned(problem, backends)
        config.benchmark_space = "all"
        full = tuned(problem, backends, verify_all=True)     # its rows are the ground truth: every one checked
    finally:
        config._overrides.clear()
        config._overrides.update(saved)
    ratios = []
    if fast["winner"] != full["winner"]:
        first = make_inputs(problem, "cuda", seed=1)
        for _ in range(repeats):
            fast_ms, full_ms = timed_together(problem, first, fast["runner"].launch, full["runner"].launch, budget_ms)
            ratios.append(fast_ms / full_ms)
    if truth_csv:
        append_rows(truth_csv, selection_rows(full["selection"], run_env()))
    for r in (fast, full):
        r.pop("runner")
        r.pop("selection")
    return {"fast": fast, "exhaustive": full, "side_by_side": ratios}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--problems", type=parse_problems, required=True, help="DTYPE:MxNxK,... (bf16, fp16, int8)")
    ap.add_argument("--backends", default="aten,triton")
    ap.add_argument("--time-limit-s", type=float, default=250.0, help="start no new problem after this")
    ap.add_argument("--json")
    ap.add_argument("--truth-csv", help="append every exhaustive candidate's timing here (dataset CSV)")
    args = ap.parse_args(argv)


    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (a full exhaustive tune under the interpreter would take hours)")
    os.environ["KERNELS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernels_exhaustive_")
    backends = tuple(args.backends.split(","))
    rows, start = [], time.perf_counter()
    for op, dtype, m, n, k in args.problems:
        if time.perf_counter() - start > args.time_limit_s:
            print(f"time limit: stopping before {dtype} {m}x{n}x{k}", flush=True)
            break
        row = {"problem": [op, dtype, m, n, k], **compare(cuda_problem(op, dtype, m, n, k), backends,
                                                                       truth_csv=args.truth_csv)}
        rows.append(row)
        f, e = row["fast"], row["exhaustive"]
        print(f"{op} {dtype} {m}x{n}x{k}: fast {f['winner']} {f['ms'] * 1e3:.1f} us ({f['benchmarks']} timed, "
              f"{f['seconds']:.1f} s) | exhaustive {e['winner']} {e['ms'] * 1e3:.1f} us ({e['benchmarks']} timed, "
              f"{e['compiles']} compiles, {e['seconds']:.1f} s) | fast/exhaustive side by side x"
              f"{len(row['side_by_side']) or 3}: {[round(r, 3) for r in row['side_by_side']] or 'same choice'}",
              flush=True)
        if args.json:          # after each problem: a run stopped by its caller keeps what it measured
            with open(args.json, "w") as fh:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, fh,
                          indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
