"""Does a CUTLASS build running on the CPU cores slow the GPU calls made meanwhile (issue 27: within 5%)?

Times kernels.mm on a few problems in 1 s back-to-back loops with nothing else running, then again while a command
(default: the background build's own, `nice -n 19 python -m kernels warmup`) runs, then idle again.
`python -m experiments.build_interference --json out.json` (GPU; the problems should already be tuned, or the
first loop includes their tune).
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time

import torch

import kernels
from kernels.core.problem import GemmProblem
from kernels.measure.verify import make_inputs, timing_sets

PROBLEMS = [(16, 12288, 4096), (1024, 1024, 1024), (4096, 4096, 4096)]


def _loop_ms(fn, sets, seconds: float = 1.0) -> float:
    """ms per call over a `seconds` back-to-back loop of the user's call (host included)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn(*sets[calls % len(sets)])
        calls += 1
        if calls % 64 == 0:
            torch.cuda.synchronize()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def _measure(inputs) -> dict[str, float]:
    return {name: _loop_ms(kernels.mm, sets) for name, sets in inputs.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--during", default=f"nice -n 19 {sys.executable} -m kernels warmup --backends cutlass",
                   help="the command whose run the middle measurement overlaps")
    args = p.parse_args(argv)
    inputs = {}
    for m, n, k in PROBLEMS:
        a = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.empty(k, n, device="cuda", dtype=torch.bfloat16)
        problem = GemmProblem.from_tensors("mm", a, b)
        first = make_inputs(problem, "cuda", seed=1)
        inputs[f"{m}x{n}x{k}"] = timing_sets(problem, "cuda", first, seed=2)
        kernels.mm(*first)
    before = _measure(inputs)
    proc = subprocess.Popen(shlex.split(args.during), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(3.0)                                    # past the build's start-up, into nvcc
    during = _measure(inputs)
    still_running = proc.poll() is None
    proc.wait()
    after = _measure(inputs)
    rows = [{"problem": k, "idle_before_ms": before[k], "during_ms": during[k], "idle_after_ms": after[k],
             "slowdown": during[k] / min(before[k], after[k]) - 1} for k in inputs]
    out = {"during": args.during, "build_still_running_at_end_of_measure": still_running, "rows": rows}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
