"""`python -m bench.core_slice`: the core issue's numbers in one run.

- kernels.mm vs torch.mm user-visible steady-state time on the core set (bf16 and int8), geomean, selection regret;
- cold tune of a new shape in a fresh cache dir, then a new shape whose binaries are built (same specialisation,
  other M), both timed as the first kernels.mm call in a child process;
- warm start: a fresh process with that cache dir, time from after `import torch, kernels` to the first mm;
- warm dispatch host cost at 64x64x64: kernels.mm vs torch.mm, back-to-back loop, and host-only time per call.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from bench.results import KernelsMmResult, geomean

# new shapes for the cold-tune measurement: M differs, N/K and 16-divisibility (the specialisation) do not
COLD_SHAPE = (1536, 4096, 4096)
SAME_SPEC_SHAPE = (2560, 4096, 4096)
CPU_COLD_SHAPE, CPU_SAME_SPEC_SHAPE = (48, 32, 64), (80, 32, 64)


@dataclass
class DispatchCost:
    calls: int
    kernels_loop_us: float      # per call, loop then one synchronize (what a user's loop sees)
    torch_loop_us: float
    kernels_host_us: float      # per call, host time only (no synchronize inside the timed region)
    torch_host_us: float


@dataclass
class CoreSliceReport:
    env: dict
    backends: list[str]
    rows: list[dict] = field(default_factory=list)       # shape, dtype, KernelsMmResult fields
    geomean_speedup: dict = field(default_factory=dict)  # dtype -> geomean torch/kernels
    max_regret: dict = field(default_factory=dict)
    cold: dict = field(default_factory=dict)
    warm_start: dict = field(default_factory=dict)
    dispatch: DispatchCost | None = None
    mode: str = "gpu"


def _child(cache_dir: str, backends: str, dtype: str, shapes, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "bench.firstcall", "--cache-dir", cache_dir, "--backends", backends,
           "--dtype", dtype] + [a for s in shapes for a in ("--shape", ",".join(map(str, s)))]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout:.0f} s: {' '.join(cmd)}"}
    if res.returncode != 0:
        return {"error": f"exit {res.returncode}: {res.stderr.strip()[-800:]}"}
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as e:
        return {"error": f"unreadable child output ({e}): {res.stdout[-400:]}"}


def dispatch_cost(dtype: str, calls: int, device: str) -> DispatchCost:
    """Warm host cost: the same 64^3 tensors, kernels.mm (tuned, dispatch table hit) vs torch.mm."""
    import torch

    import kernels
    from bench.measure import op_for, problem_for
    from bench.shapes import Shape
    from kernels.verify import make_inputs

    problem = problem_for(Shape(64, 64, 64), dtype, "nn", device)
    a, b = make_inputs(problem, device)
    fns = {"kernels": kernels.int_mm if op_for(dtype) == "int_mm" else kernels.mm,
           "torch": torch._int_mm if op_for(dtype) == "int_mm" else torch.mm}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    result = {}
    for name, fn in fns.items():
        for _ in range(50):     # first call tunes; the rest warm the dispatch path
            fn(a, b)
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(a, b)
        sync()
        result[f"{name}_loop_us"] = (time.perf_counter() - t0) / calls * 1e6
        # host only: fewer calls so the launch queue never fills and blocks the host
        host_calls = min(calls, 500)
        t0 = time.perf_counter()
        for _ in range(host_calls):
            fn(a, b)
        result[f"{name}_host_us"] = (time.perf_counter() - t0) / host_calls * 1e6
        sync()
    return DispatchCost(calls=calls, **result)


def run(args, no_gpu: bool, progress) -> CoreSliceReport:
    from bench.device import environment
    from bench.measure import kernels_mm_result, problem_for, rotated_sets
    from bench.shapes import parse_shapes
    from kernels.config import config

    device = "cpu" if no_gpu else "cuda"
    if no_gpu:
        import torch
        torch.set_num_threads(1)   # CPU numbers on a shared machine: no thread-pool contention
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    if "aten" not in backends:
        backends = ("aten",) + backends
    config.backends = backends
    report = CoreSliceReport(env=environment(), backends=list(backends), mode="cpu-interpreter" if no_gpu else "gpu")
    for dtype in args.dtypes.split(","):
        speedups, regrets = [], []
        for shape in parse_shapes(args.shapes, dtype):
            progress(f"kernels.mm vs torch.mm {shape.label()} {dtype}")
            problem = problem_for(shape, dtype, "nn", device)
            r: KernelsMmResult = kernels_mm_result(problem, backends, rotated_sets(problem, device),
                                                   config.bench_budget_ms)
            report.rows.append({"shape": shape.label(), "dtype": dtype, **asdict(r)})
            if r.status == "ok":
                speedups.append(r.speedup)
                if r.regret is not None:
                    regrets.append(r.regret)
        report.geomean_speedup[dtype] = geomean(speedups)
        report.max_regret[dtype] = max(regrets) if regrets else None
    cold, same = (CPU_COLD_SHAPE, CPU_SAME_SPEC_SHAPE) if no_gpu else (COLD_SHAPE, SAME_SPEC_SHAPE)
    with tempfile.TemporaryDirectory(prefix="kernels-core-slice-") as fresh:
        progress(f"cold tune {cold} then same-specialisation {same} in a fresh cache dir {fresh}")
        report.cold = _child(fresh, ",".join(backends), "bf16", [cold, same], args.child_timeout)
        progress("warm start: fresh process, same cache dir")
        report.warm_start = _child(fresh, ",".join(backends), "bf16", [cold], args.child_timeout)
    progress(f"warm dispatch host cost 64x64x64, {args.calls} calls")
    report.dispatch = dispatch_cost("bf16", args.calls, device)
    return report


def _s(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_report(rep: CoreSliceReport) -> str:
    lines = [f"core slice on {rep.env.get('gpu')} ({rep.mode}), backends {','.join(rep.backends)}, "
             f"torch {rep.env.get('torch')}, triton {rep.env.get('triton')}, {rep.env.get('date')}"]
    if rep.mode != "gpu":
        lines.append("NO GPU: CPU times (Triton interpreter) - correctness only, not performance")
    lines.append(f"{'shape':<18}{'dtype':<6}{'kernels.mm ms':>14}{'torch ms':>11}{'speedup':>9}{'regret':>8}"
                 f"  winner")
    for r in rep.rows:
        if r["status"] != "ok":
            lines.append(f"{r['shape']:<18}{r['dtype']:<6}  error: {r['message'][:100]}")
            continue
        lines.append(f"{r['shape']:<18}{r['dtype']:<6}{r['mm_ms']:>14.4f}{r['torch_ms']:>11.4f}"
                     f"{r['speedup']:>8.3f}x{_s(None if r['regret'] is None else 100 * r['regret'], '.1f'):>7}%"
                     f"  {r['winner']} [{r['source']}]")
    for dtype, g in rep.geomean_speedup.items():
        reg = rep.max_regret.get(dtype)
        lines.append(f"geomean {dtype}: {_s(g)}x torch.mm, max regret {_s(None if reg is None else 100 * reg, '.1f')}%")
    for label, data in (("cold tune (fresh cache)", rep.cold), ("warm start (fresh process)", rep.warm_start)):
        if "error" in data:
            lines.append(f"{label}: error {data['error']}")
            continue
        for i, r in enumerate(data.get("results", [])):
            what = label if i == 0 else "new shape, binaries built"
            lines.append(f"{what:<28} {'x'.join(map(str, r['shape'])):<16} first call {r['first_call_s']:.3f} s "
                         f"(since import {r['since_import_s']:.3f} s, {r.get('compiles', 0)} compiles, "
                         f"source {r['source']})")
    d = rep.dispatch
    if d is not None:
        lines.append(f"dispatch 64^3 x{d.calls}: kernels.mm {d.kernels_loop_us:.1f} us/call vs torch.mm "
                     f"{d.torch_loop_us:.1f}; host only {d.kernels_host_us:.1f} vs {d.torch_host_us:.1f} us")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.core_slice", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="aten,triton")
    p.add_argument("--shapes", default=None, help="suite or file (default: core on a GPU, tiny without one)")
    p.add_argument("--dtypes", default="bf16,int8")
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--child-timeout", type=float, default=300.0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    from bench.compare import Progress, ensure_interpreter_without_gpu
    no_gpu = ensure_interpreter_without_gpu(argv, module="bench.core_slice")
    if args.shapes is None:
        args.shapes = "tiny" if no_gpu else "core"
    rep = run(args, no_gpu, Progress(False))
    print(format_report(rep))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(rep), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
