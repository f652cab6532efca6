"""Showed the default preset's speedup over torch.mm side by side on the H100: issue 3's suite geomean 1.744, the core
suite 1.855 (thirteenth session; `bash bench/gpu_check.sh native`, the team's GPU check, runs it).

Quick GPU measurement of the core slice: kernels.mm vs torch.mm side by side, tuning cost, warm-start latency,
host cost. `python -m experiments.core_quick --json out.json`. Prints a table last."""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import textwrap
import time

import torch

import kernels
from backends.base import Runner
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.dispatch import api
from kernels.dispatch.api import _fast_key
from kernels.measure.timing import device_time_ms, measure_together, user_call
from kernels.measure.verify import make_inputs, timing_sets

BF16 = [(1024, 1024, 1024), (4096, 4096, 4096), (8192, 8192, 8192), (16, 12288, 4096), (64, 4096, 11008),
        (64, 22016, 4096), (3000, 2000, 1000)]
INT8 = [(256, 12288, 4096), (1024, 22016, 4096), (4096, 4096, 4096)]
# issue 3's target table (split-K, skinny, large, misaligned, int8)
ISSUE3_BF16 = [(32, 32, 4096), (32, 32, 16384), (32, 32, 32768), (16, 12288, 4096), (16, 4096, 11008),
               (64, 4096, 11008), (4096, 4096, 4096), (8192, 8192, 8192), (8192, 14336, 4096), (4096, 4096, 14336),
               (2047, 2047, 2047)]
# int8 with B K-major (column-major) first: the layout issue 3's torch._int_mm baselines were taken in (235 / 160 us;
# with a row-major B cuBLAS takes 1085 us for 4096^3), then row-major B (triton_kmajor_int8_mm's case)
ISSUE3_INT8 = [(1024, 22016, 4096, "col"), (4096, 4096, 4096, "col"), (1024, 22016, 4096, "row"),
               (4096, 4096, 4096, "row")]
SUITES = {"core": (BF16, INT8), "issue3": (ISSUE3_BF16, ISSUE3_INT8)}


def side_by_side(op: str, m: int, n: int, k: int, b_layout: str = "row") -> dict:
    dtype = torch.int8 if op == "int_mm" else torch.bfloat16
    a, b = make_inputs(GemmProblem.from_tensors(op, *_probe(dtype, m, n, k, b_layout)), "cuda", seed=1)
    fn = kernels.int_mm if op == "int_mm" else kernels.mm
    t0 = time.perf_counter()
    fn(a, b)
    torch.cuda.synchronize()
    tune_s = time.perf_counter() - t0
    sel = kernels.explain(a, b, op=op)
    problem = sel.problem
    sets = timing_sets(problem, "cuda", (a, b), seed=2)        # the rotation tuning times over
    aten = torch._int_mm if op == "int_mm" else torch.mm
    calls = {"kernels": user_call(lambda x, y, o: fn(x, y), sets),
             "aten": user_call(lambda x, y, o: aten(x, y), sets)}
    t = measure_together(calls, len(sets), "cuda", 400.0)
    try:
        gpu = {"kernels": graph_us(fn, a, b), "aten": graph_us(aten, a, b)}
    except Exception as e:  # noqa: BLE001 - graph capture is a diagnostic; its failure is data
        gpu = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    ranked = sel.ranked()
    best_name, best_ms = ranked[0]
    win_ms = sel.timings[sel.winner]
    best_triton = next(((nm, ms) for nm, ms in ranked if nm.startswith("triton")), (None, float("nan")))
    per_template: dict[str, list] = {}
    for nm, ms in ranked:
        per_template.setdefault(sel.choices[nm].template, [nm, round(ms * 1e3, 2)])
    peak = 1979e12 if op == "int_mm" else 989e12       # H100/H200 dense tensor-core peak (ops/s)
    return {"op": op, "shape": [m, n, k], "b_layout": b_layout, "winner": sel.winner, "kernels_ms": t["kernels"].median_ms,
            "aten_ms": t["aten"].median_ms, "speedup": t["aten"].median_ms / t["kernels"].median_ms,
            "regret": win_ms / best_ms, "best_triton": best_triton[0],
            "triton_vs_aten": sel.timings.get("aten_int_mm" if op == "int_mm" else "aten_mm", float("nan")) / best_triton[1]
            if isinstance(sel.timings.get("aten_int_mm" if op == "int_mm" else "aten_mm"), float) else None,
            "tune_s": tune_s, "failures": len(sel.failures()), "stats": kernels.stats(),
            "best_per_template_us": per_template, "graph_gpu_us": gpu, "notes": list(sel.notes),
            "floor_pct": 100 * max(2 * m * n * k / peak, problem.min_bytes / 4.27e12) * 1e3 / t["kernels"].median_ms}


def graph_us(fn, a, b) -> float:
    """GPU time per call without host cost (kernels.timing.device_time_ms: the measurement tuning uses)."""

    ms = device_time_ms(lambda i: fn(a, b), 1)
    if ms is None:
        raise RuntimeError("the call could not be captured in a CUDA graph")
    return ms * 1e3


def _probe(dtype, m, n, k, b_layout="row"):
    b = torch.empty(n, k, device="cuda", dtype=dtype).t() if b_layout == "col" else \
        torch.empty(k, n, device="cuda", dtype=dtype)
    return torch.empty(m, k, device="cuda", dtype=dtype), b


def host_cost(n_calls: int = 3000) -> dict:
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    kernels.mm(a, b)

    res = {}
    fast_call = api._fast_call

    contenders = [("torch.mm", torch.mm), ("kernels.mm", kernels.mm)]
    if fast_call is not None:
        contenders.append(("kernels.mm python path", None))
    for name, fn in contenders * 2:
        if fn is None:
            api._fast_call = None
            fn = kernels.mm
        try:
            for _ in range(200):
                fn(a, b)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn(a, b)
            host = (time.perf_counter() - t0) / n_calls * 1e6
            torch.cuda.synchronize()
        finally:
            api._fast_call = fast_call
        res[name] = min(res.get(name, 1e9), host)
    res["fastpath"] = kernels.fastpath_status()

    for name, fn in (("fast_key", lambda: _fast_key("mm", a, b)),
                     ("torch.empty", lambda: torch.empty((64, 64), dtype=torch.bfloat16, device="cuda"))):
        t0 = time.perf_counter()
        for _ in range(n_calls):
            fn()
        res[name] = (time.perf_counter() - t0) / n_calls * 1e6
    res["winner"] = kernels.explain(a, b).winner
    res["ratio"] = res["kernels.mm"] / res["torch.mm"]
    # a Triton winner's warm call (the C++ table launches it natively when loaded): 64x64x128, Triton only
    a2 = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    b2 = torch.randn(128, 64, device="cuda", dtype=torch.bfloat16)
    backends = kernels.config.backends
    kernels.config.backends = ("triton",)
    try:
        kernels.mm(a2, b2)
    finally:
        kernels.config.backends = backends
    for _ in range(200):
        kernels.mm(a2, b2)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        kernels.mm(a2, b2)
    res["kernels.mm triton winner"] = (time.perf_counter() - t0) / n_calls * 1e6
    torch.cuda.synchronize()
    res["triton_winner"] = kernels.explain(a2, b2).winner
    return res


WARM_START = textwrap.dedent("""
    import json, time, torch
    import kernels
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.mm(b[:64, :64], b[:64, :64]); torch.cuda.synchronize()     # CUDA context and cuBLAS start-up are torch's, not ours
    t0 = time.perf_counter(); mm = kernels.mm; t_import = time.perf_counter() - t0   # the lazy root loads the api here
    t0 = time.perf_counter(); mm(a, b); torch.cuda.synchronize(); dt = time.perf_counter() - t0
    print(json.dumps({"first_call_ms": dt * 1e3, "api_import_ms": t_import * 1e3, "stats": kernels.stats(),
                      "winner": kernels.explain(a, b).winner}))
""")


def warm_start(cache_dir: str, backends: str) -> dict:
    env = dict(os.environ, KERNELS_CACHE_DIR=cache_dir, KERNELS_BACKENDS=backends)
    out = subprocess.run([sys.executable, "-c", WARM_START], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m experiments.core_quick", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write every row, the host cost and the warm start here")
    ap.add_argument("--backends", default="aten,triton", help="KERNELS_BACKENDS for kernels.mm (default %(default)s)")
    ap.add_argument("--suite", choices=sorted(SUITES), default="core",
                    help="core: the core issue's shapes; issue3: issue 3's target table (default %(default)s)")
    ap.add_argument("--fastpath", choices=("build", "off"), default="build",
                    help="the C++ warm-call table: built before measuring (default), or off (Python dispatch)")
    args = ap.parse_args()

    cache = tempfile.mkdtemp(prefix="kernels_core_")
    os.environ["KERNELS_CACHE_DIR"] = cache
    os.environ["KERNELS_FASTPATH"] = args.fastpath      # the warm-start child process too
    kernels.config.backends = tuple(args.backends.split(","))
    t0 = time.perf_counter()
    print(f"fastpath: {kernels.load_fastpath()} ({time.perf_counter() - t0:.1f} s)", flush=True)
    rows = []
    bf16, int8 = SUITES[args.suite]
    for op, shapes in (("mm", bf16), ("int_mm", int8)):
        for m, n, k, *b_layout in shapes:
            try:
                rows.append(side_by_side(op, m, n, k, *b_layout))
            except Exception as e:  # noqa: BLE001
                rows.append({"op": op, "shape": [m, n, k], "error": f"{type(e).__name__}: {e}"})
            print(json.dumps(rows[-1]), flush=True)
    # a new shape whose binaries are built: same specialisation as 4096^3 bf16 with M=2048
    before = kernels.stats()["compiles"]
    a = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter(); kernels.mm(a, b); torch.cuda.synchronize()
    rebuilt = {"new_shape_tune_s": time.perf_counter() - t0, "compiles": kernels.stats()["compiles"] - before}
    hc = host_cost()
    ws = warm_start(cache, args.backends)
    summary = {"rows": rows, "new_shape_with_built_binaries": rebuilt, "host_cost_us": hc, "warm_start": ws,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "fastpath": kernels.fastpath_status()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    ok = [r for r in rows if "speedup" in r]
    print(f"\n{'op':6} {'shape':>20} {'winner':44} {'kernels us':>10} {'aten us':>9} {'speedup':>7} {'regret':>6} "
          f"{'tune s':>6} {'%floor':>6} {'triton/aten':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:6} {str(r['shape']):>20} ERROR {r['error'][:120]}")
            continue
        tva = r["triton_vs_aten"]
        label = "x".join(map(str, r["shape"])) + ("" if r.get("b_layout", "row") == "row" else " Bc")
        print(f"{r['op']:6} {label:>20} {r['winner'][:44]:44} {r['kernels_ms'] * 1e3:10.1f} "
              f"{r['aten_ms'] * 1e3:9.1f} {r['speedup']:7.3f} {r['regret']:6.3f} {r['tune_s']:6.2f} "
              f"{r['floor_pct']:6.1f} {tva if tva is None else round(tva, 3)!s:>11}")
    for r in ok:
        print("x".join(map(str, r["shape"])), r["op"], "B", r["b_layout"], "best per template (us):",
              {t: v[1] for t, v in r["best_per_template_us"].items()}, "| GPU-only us (graph):",
              {k: round(v, 2) if isinstance(v, float) else v for k, v in r["graph_gpu_us"].items()})
    if ok:
        print("geomean speedup", round(math.exp(sum(math.log(r["speedup"]) for r in ok) / len(ok)), 4),
              " median tune s", sorted(r["tune_s"] for r in ok)[len(ok) // 2])
    print("new shape with built binaries:", rebuilt)
    print("host cost us:", hc)
    print("warm start:", ws)


if __name__ == "__main__":
    main()
