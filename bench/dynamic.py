"""Dynamic shapes on the GPU (issue 7): the Hint x Runtime table and the log-uniform M sweep against static tuning.

    python -m bench.dynamic --out results/dynamic.json        # writes results/dynamic.json and results/dynamic.md

Per (K, N) (default (4096, 12288) and (11008, 4096), bf16):
1. Hint x Runtime: for each hint H (64, 256, 4096) the winner tuned at M=H (a dynamic-M problem), run at runtime
   M = each hint ("before": one hint serves every M), next to kernels.mm(dynamic=...) in benchmark and in similarity
   mode ("after": multi-kernel) and a statically tuned kernels.mm at that M; all timed together per runtime M.
2. Sweep: --num-m values of M spread log-uniformly over [1, 8192]; for each, static kernels.mm (tuned for exactly that
   M) vs dynamic kernels.mm in both modes, timed together; geomean and worst ratio per mode against the issue's
   targets, and the tuning cost of each way.
The static per-M tunes dominate the run time. --time-limit-s (default 330) bounds the whole run: M values are
visited in an order that spreads them over the range (bit-reversed), and the ones left when time runs out are rows
marked "skipped: time limit" (so a short run still covers the range). One failing M is an error row, not a crash.
Without a GPU it runs through the Triton interpreter on tiny shapes (fp16) to exercise the code, not to measure.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from kernels.core import dynamic_spec

DEFAULT_SHAPES = "4096x12288,11008x4096"           # K x N
DEFAULT_HINTS = ",".join(map(str, dynamic_spec.DEFAULT_HINTS))
TARGETS = {"benchmark": {"geomean": 1.03, "worst": 1.10}, "similarity": {"geomean": 1.05, "worst": 1.20}}
MODES = ("benchmark", "similarity")


# -- pure helpers (tested on CPU) -----------------------------------------------------------------------------
def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'4096x12288,11008x4096' -> [(K, N), ...]"""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            k, n = (int(x) for x in part.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r} is not KxN (e.g. 4096x12288)") from None
        if k < 1 or n < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r}: K and N must be positive")
        out.append((k, n))
    if not out:
        raise argparse.ArgumentTypeError("no shapes given")
    return out


def parse_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need positive integers")
    return values


def parse_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        lo = hi = 0
    if not 1 <= lo < hi:
        raise argparse.ArgumentTypeError(f"{text!r} is not LO,HI with 1 <= LO < HI")
    return lo, hi


def log_uniform_sizes(lo: int, hi: int, count: int) -> list[int]:
    """`count` distinct integers spread log-uniformly over [lo, hi], both ends included (each at least one more
    than the previous: at the low end log spacing is below 1)."""
    if count < 1 or lo < 1 or hi < lo or count > hi - lo + 1:
        raise ValueError(f"cannot pick {count} distinct sizes in [{lo}, {hi}]")
    if count == 1:
        return [lo]
    out: list[int] = []
    for i in range(count):
        want = round(lo * (hi / lo) ** (i / (count - 1)))
        out.append(min(max(want, out[-1] + 1 if out else lo), hi - (count - 1 - i)))
    return out


def spread_order(n: int) -> list[int]:
    """0..n-1 in bit-reversed order: any prefix covers the range evenly (a time-limited run stays representative)."""
    bits = max(1, (n - 1).bit_length())
    return sorted(range(n), key=lambda i: int(format(i, f"0{bits}b")[::-1], 2))


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summarize(rows: list[dict]) -> dict:
    """Per mode: geomean / worst of dynamic time over static time, against the issue's targets; tuning costs."""
    out: dict = {"measured": sum(1 for r in rows if "static_ms" in r), "errors": sum(1 for r in rows if "error" in r),
                 "skipped": sum(1 for r in rows if "skipped" in r)}
    for mode in MODES:
        ratios = [(r[f"{mode}_ms"] / r["static_ms"], r["m"]) for r in rows
                  if isinstance(r.get(f"{mode}_ms"), float) and isinstance(r.get("static_ms"), float)]
        if not ratios:
            out[mode] = {"n": 0}
            continue
        worst = max(ratios)
        g = geomean([x for x, _ in ratios])
        t = TARGETS[mode]
        out[mode] = {"n": len(ratios), "geomean": g, "worst": worst[0], "worst_m": worst[1],
                     "meets_geomean": g <= t["geomean"], "meets_worst": worst[0] <= t["worst"],
                     "first_call_s": sum(r.get(f"{mode}_first_call_s", 0.0) for r in rows),
                     "runtime_benchmark_s": sum(r.get(f"{mode}_bucket_s", 0.0) for r in rows),
                     "buckets_benchmarked": sum(1 for r in rows if r.get(f"{mode}_source") == "benchmarked"),
                     "compiles": sum(r.get(f"{mode}_compiles", 0) for r in rows)}
    out["static_tune_s"] = sum(r.get("static_tune_s", 0.0) for r in rows)
    return out


def _fmt_ms(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) else "—"


def markdown(report: dict) -> str:
    """The report as markdown: per shape, the Hint x Runtime table, then the sweep summary and rows."""
    lines = [f"# Dynamic shapes: multi-kernel size hints ({report.get('device', '?')}, torch {report.get('torch', '?')}, "
             f"triton {report.get('triton', '?')})", "",
             f"dtype {report.get('dtype')}, hints {report.get('hints')}, backends {report.get('backends')}, "
             f"bucket rule {report.get('buckets')}, benchmark pool {report.get('pool', 1)} per hint, "
             f"run {report.get('seconds', 0):.0f} s"
             + (f", time limit {report['time_limit_s']:.0f} s" if report.get("time_limit_s") else ""), ""]
    for shape in report.get("shapes", []):
        k, n = shape["k"], shape["n"]
        lines += [f"## K={k}, N={n}", ""]
        if "error" in shape:
            lines += [f"ERROR: {shape['error']}", ""]
            continue
        tune = shape.get("hint_tunes", {})
        if tune:
            lines += ["Hint winners (tuned with M dynamic): " + ", ".join(
                f"M={h}: `{w['winner']}` ({w['tune_s']:.2f} s)" for h, w in tune.items()), ""]
        table = shape.get("hint_table", {})
        runtimes = table.get("runtime_m", [])
        if runtimes:
            lines += ["Hint × runtime M, ms per call (before: one hint's winner serves every M; after: "
                      "kernels.mm(dynamic=...))", "",
                      "| kernel | " + " | ".join(f"M={m}" for m in runtimes) + " |",
                      "|---|" + "---|" * len(runtimes)]
            for label, cells in table.get("rows", {}).items():
                lines.append(f"| {label} | " + " | ".join(_fmt_cell(cells.get(str(m))) for m in runtimes) + " |")
            lines.append("")
        sweep = shape.get("sweep")
        if sweep:
            s = sweep["summary"]
            lines += [f"Sweep: {s['measured']} values of M in [{sweep['range'][0]}, {sweep['range'][1]}] measured "
                      f"({s['errors']} errors, {s['skipped']} skipped), dynamic time / static per-M tuned time:", "",
                      "| mode | n | geomean | worst (M) | target geomean / worst | met | runtime benchmarks | "
                      "first calls s | compiles |", "|---|---|---|---|---|---|---|---|---|"]
            for mode in MODES:
                d = s.get(mode, {})
                if not d.get("n"):
                    lines.append(f"| {mode} | 0 | — | — | — | — | — | — | — |")
                    continue
                t = TARGETS[mode]
                met = "yes" if d["meets_geomean"] and d["meets_worst"] else "no"
                lines.append(f"| {mode} | {d['n']} | {d['geomean']:.3f} | {d['worst']:.3f} ({d['worst_m']}) | "
                             f"≤{t['geomean']} / ≤{t['worst']} | {met} | {d['buckets_benchmarked']} buckets, "
                             f"{d['runtime_benchmark_s']:.2f} s | {d['first_call_s']:.2f} | {d['compiles']} |")
            hint_s = sum(w["tune_s"] for w in tune.values())
            lines += ["", f"Tuning cost: hints {hint_s:.1f} s (once) + runtime bucket benchmarks "
                          f"{s.get('benchmark', {}).get('runtime_benchmark_s', 0.0):.2f} s (benchmark mode), "
                          f"0 (similarity mode); static per-M tuning {s['static_tune_s']:.1f} s.", "",
                      "| M | static ms | benchmark ms | ratio | similarity ms | ratio | static winner | "
                      "benchmark: hint (source) | similarity: hint |", "|---|---|---|---|---|---|---|---|---|"]
            for r in sorted(sweep["rows"], key=lambda r: r["m"]):
                if "error" in r or "skipped" in r:
                    lines.append(f"| {r['m']} | {r.get('error') or r.get('skipped')} | | | | | | | |")
                    continue
                lines.append(
                    f"| {r['m']} | {_fmt_ms(r.get('static_ms'))} | {_fmt_ms(r.get('benchmark_ms'))} | "
                    f"{_ratio(r, 'benchmark')} | {_fmt_ms(r.get('similarity_ms'))} | {_ratio(r, 'similarity')} | "
                    f"{r.get('static_winner', '')} | {r.get('benchmark_hint', '')} ({r.get('benchmark_source', '')}) | "
                    f"{r.get('similarity_hint', '')} |")
            lines.append("")
    return "\n".join(lines) + "\n"


def _fmt_cell(cell) -> str:
    if cell is None:
        return "—"
    if "error" in cell:
        return "error"
    txt = f"{cell['ms']:.4f}"
    return f"{txt} ({cell['hint']})" if cell.get("hint") else txt


def _ratio(r: dict, mode: str) -> str:
    a, s = r.get(f"{mode}_ms"), r.get("static_ms")
    return f"{a / s:.3f}" if isinstance(a, float) and isinstance(s, float) and s > 0 else "—"


def out_paths(out: str) -> tuple[Path, Path]:
    p = Path(out)
    if p.suffix == ".json":
        return p, p.with_suffix(".md")
    return p / "dynamic.json", p / "dynamic.md"


# -- measurement ----------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args):
        import torch

        import kernels

        self.torch, self.kernels, self.args = torch, kernels, args
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.dyn = {mode: kernels.Dynamic("m", hints=args.hints, mode=mode, buckets=args.buckets) for mode in MODES}

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def inputs(self, m, k, n, seed):
        g = self.torch.Generator(device=self.device)
        g.manual_seed(seed)
        a = self.torch.randn(m, k, device=self.device, generator=g).to(self.dtype)
        b = self.torch.randn(k, n, device=self.device, generator=g).to(self.dtype)
        return a, b

    def timed_first_call(self, fn):
        before = self.kernels.stats()
        t0 = time.perf_counter()
        fn()
        self.sync()
        after = self.kernels.stats()
        return time.perf_counter() - t0, {k: after[k] - before[k] for k in after}

    def measure(self, calls: dict, problem) -> dict[str, float | str]:
        """Time the callables fn(a, b) together over rotated input sets of this problem (kernels.timing)."""
        from kernels.measure.timing import measure_together
        from kernels.measure.verify import fresh_timing_sets

        sets = fresh_timing_sets(problem, self.device, 100)
        n_sets = len(sets)
        wrapped = {name: (lambda fn: (lambda i: fn(*sets[i])))(fn) for name, fn in calls.items()}
        res = measure_together(wrapped, n_sets, self.device, self.args.measure_ms * len(calls))
        return {name: t.median_ms for name, t in res.items()}

    def hint_tunes(self, k, n) -> dict:
        from kernels.dispatch import dynamic as dyn_mod
        from kernels.core.problem import GemmProblem

        a, b = self.inputs(self.args.hints[0], k, n, seed=1)
        secs, _ = self.timed_first_call(lambda: self.kernels.mm(a, b, dynamic=self.dyn["similarity"]))
        problem = GemmProblem.from_tensors("mm", a, b)
        fam = dyn_mod.family_for(dyn_mod.substitute(problem, {}, ("m",)), dyn_mod.resolve(self.dyn["similarity"]))
        # the tune's fastest few too: whether a hint's winner won clearly or by a hair explains how it serves others
        return {str(hw.sizes["m"]): {"winner": hw.choice.name, "tune_s": hw.selection.tune_seconds,
                                     "source": hw.selection.source,
                                     "fastest_us": {name: round(t * 1e3, 2) for name, t in hw.selection.ranked()[:5]}}
                for hw in fam.winners}, secs

    def hint_table(self, k, n, winners: dict) -> dict:
        """Before: kernels.mm(dynamic=Dynamic('m', hints=(H,))) - one hint's winner serves every M, through the same
        warm path as the rest (its hint problem is the one already tuned: nothing is re-tuned). After: all hints."""
        from kernels.core.problem import GemmProblem

        single = {h: self.kernels.Dynamic("m", hints=(int(h),), mode="similarity") for h in winners}
        rows: dict[str, dict] = {f"hint M={h} (before)": {} for h in winners}
        rows.update({f"multi-kernel {mode} (after)": {} for mode in MODES})
        rows["static tuned at this M"] = {}
        for rm in self.args.hints:
            a, b = self.inputs(rm, k, n, seed=2)
            problem = GemmProblem.from_tensors("mm", a, b)
            calls, hints = {}, {}
            for h, d in single.items():
                try:
                    self.kernels.mm(a, b, dynamic=d)
                    calls[f"hint M={h} (before)"] = (lambda dd: (lambda x, y: self.kernels.mm(x, y, dynamic=dd)))(d)
                except Exception as e:  # noqa: BLE001 - e.g. the hint's winner cannot run this M
                    rows[f"hint M={h} (before)"][str(rm)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            for mode in MODES:
                self.kernels.mm(a, b, dynamic=self.dyn[mode])
                hints[mode] = self.kernels.explain(a, b, dynamic=self.dyn[mode]).decision.hint
                calls[f"multi-kernel {mode} (after)"] = (lambda d: (lambda x, y: self.kernels.mm(x, y, dynamic=d)))(
                    self.dyn[mode])
            self.kernels.mm(a, b)
            calls["static tuned at this M"] = lambda x, y: self.kernels.mm(x, y)
            times = self.measure(calls, problem)
            for label, ms in times.items():
                cell = {"ms": ms}
                for mode in MODES:
                    if label.startswith(f"multi-kernel {mode}"):
                        cell["hint"] = hints[mode]
                rows[label][str(rm)] = cell
        return {"runtime_m": list(self.args.hints), "rows": rows}

    def sweep_row(self, k, n, m) -> dict:
        from kernels.core.problem import GemmProblem

        a, b = self.inputs(m, k, n, seed=3)
        problem = GemmProblem.from_tensors("mm", a, b)
        row: dict = {"m": m}
        secs, delta = self.timed_first_call(lambda: self.kernels.mm(a, b))
        row.update(static_tune_s=secs, static_winner=self.kernels.explain(a, b).winner,
                   static_compiles=delta["compiles"])
        calls = {"static": lambda x, y: self.kernels.mm(x, y)}
        for mode in MODES:
            secs, delta = self.timed_first_call(lambda: self.kernels.mm(a, b, dynamic=self.dyn[mode]))
            d = self.kernels.explain(a, b, dynamic=self.dyn[mode]).decision
            row.update({f"{mode}_first_call_s": secs, f"{mode}_compiles": delta["compiles"],
                        f"{mode}_hint": d.hint, f"{mode}_winner": d.winner, f"{mode}_source": d.source,
                        f"{mode}_bucket": d.bucket, f"{mode}_bucket_s": d.seconds, f"{mode}_notes": d.notes})
            if mode == "benchmark" and d.timings:      # what the bucket decision saw: diagnoses a bad bucket
                row.update(benchmark_measured_at=d.measured_at, benchmark_also_measured=d.also_measured,
                           benchmark_timings_us={n: round(t * 1e3, 2) if isinstance(t, float) else t
                                                 for n, t in d.timings.items()},
                           benchmark_worst_ratio={n: round(r, 3) for n, r in d.worst_ratio.items()})
            calls[mode] = (lambda dd: (lambda x, y: self.kernels.mm(x, y, dynamic=dd)))(self.dyn[mode])
        times = self.measure(calls, problem)
        row["static_ms"] = times["static"]
        for mode in MODES:
            row[f"{mode}_ms"] = times[mode]
        return row

    def shape(self, k, n, deadline: float) -> dict:
        out: dict = {"k": k, "n": n}
        winners, secs = self.hint_tunes(k, n)
        out["hint_tunes"] = winners
        out["first_dynamic_call_s"] = secs
        if not self.args.no_table:
            try:
                out["hint_table"] = self.hint_table(k, n, winners)
            except Exception as e:  # noqa: BLE001
                out["hint_table"] = {"error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
        if self.args.num_m:
            ms = log_uniform_sizes(self.args.m_range[0], self.args.m_range[1], self.args.num_m)
            rows: list[dict] = []
            for i in spread_order(len(ms)):
                m = ms[i]
                if time.monotonic() > deadline:
                    rows.append({"m": m, "skipped": "skipped: time limit"})
                    continue
                try:
                    rows.append(self.sweep_row(k, n, m))
                except Exception as e:  # noqa: BLE001 - one failing M is a row, not the end of the run
                    rows.append({"m": m, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                    traceback.print_exc()
                print(json.dumps({"k": k, "n": n, **rows[-1]}), flush=True)
            out["sweep"] = {"range": list(self.args.m_range), "rows": rows, "summary": summarize(rows)}
        return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.dynamic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="x.json (writes x.json and x.md) or a directory")
    ap.add_argument("--shapes", type=parse_shapes, default=None, help=f"KxN list (default {DEFAULT_SHAPES})")
    ap.add_argument("--hints", type=parse_ints, default=None, help=f"size hints for M (default {DEFAULT_HINTS})")
    ap.add_argument("--num-m", type=int, default=64, help="M values in the sweep (0: no sweep)")
    ap.add_argument("--m-range", type=parse_range, default=None, help="LO,HI of the sweep (default 1,8192)")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 (fp16 on CPU)")
    ap.add_argument("--backends", default="aten,triton", help="KERNELS_BACKENDS for every tune (default %(default)s)")
    ap.add_argument("--buckets", default="pow2", help="benchmark-mode bucket rule")
    ap.add_argument("--bench-ms", type=float, default=None,
                    help="kernels.core.config.bench_budget_ms for every tune, hints and static alike (default: config's)")
    ap.add_argument("--measure-ms", type=float, default=30.0, help="ms per callable when comparing (default 30)")
    ap.add_argument("--time-limit-s", type=float, default=330.0, help="whole-run budget; M left over are skipped")
    ap.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory (cold tuning costs)")
    ap.add_argument("--no-table", action="store_true", help="skip the Hint x Runtime table")
    return ap


def resolve_args(argv=None, has_cuda: bool | None = None) -> argparse.Namespace:
    """Parse and fill defaults (the no-GPU defaults are tiny, for the interpreter)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if has_cuda is None:
        import torch

        has_cuda = torch.cuda.is_available()
    args.cpu = not has_cuda
    if args.cpu:
        args.shapes = args.shapes or [(32, 24)]
        args.hints = args.hints or (16, 64)
        args.m_range = args.m_range or (1, 128)
        args.dtype = args.dtype or "fp16"
        if args.dtype == "bf16":
            ap.error("bf16 is not supported by the Triton interpreter (triton issue #11584): use --dtype fp16")
    else:
        args.shapes = args.shapes or parse_shapes(DEFAULT_SHAPES)
        args.hints = args.hints or parse_ints(DEFAULT_HINTS)
        args.m_range = args.m_range or (1, 8192)
        args.dtype = args.dtype or "bf16"
    if args.num_m < 0 or args.num_m > args.m_range[1] - args.m_range[0] + 1:
        ap.error(f"--num-m {args.num_m} distinct values do not fit in {args.m_range}")
    return args


def main(argv=None) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")       # before triton is imported
        print("No CUDA GPU: running through the Triton interpreter on tiny shapes (exercises the code; the "
              "numbers mean nothing)", file=sys.stderr)
    args = resolve_args(argv, torch.cuda.is_available())
    start = time.monotonic()
    os.environ["KERNELS_CACHE_DIR"] = args.cache_dir or tempfile.mkdtemp(prefix="kernels_dynamic_")
    import kernels
    from kernels.dispatch.dynamic import DYNAMIC_POOL

    kernels.config.backends = tuple(s.strip() for s in args.backends.split(",") if s.strip())
    kernels.config.dynamic = ""               # the static reference stays static whatever KERNELS_DYNAMIC says
    if args.bench_ms is not None:
        kernels.config.bench_budget_ms = args.bench_ms
    bench = Bench(args)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    report = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu (Triton interpreter)",
              "torch": torch.__version__, "triton": triton_version, "dtype": args.dtype, "hints": list(args.hints),
              "backends": list(kernels.config.backends), "buckets": args.buckets,
              "pool": DYNAMIC_POOL, "cache_dir": kernels.config.cache_dir, "time_limit_s": args.time_limit_s,
              "bench_budget_ms": kernels.config.bench_budget_ms, "targets": TARGETS, "shapes": []}
    json_path, md_path = out_paths(args.out)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    for i, (k, n) in enumerate(args.shapes):
        left = args.time_limit_s - (time.monotonic() - start)
        deadline = time.monotonic() + left / (len(args.shapes) - i)
        try:
            report["shapes"].append(bench.shape(k, n, deadline))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            report["shapes"].append({"k": k, "n": n, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        report["seconds"] = time.monotonic() - start
        report["stats"] = kernels.stats()
        json_path.write_text(json.dumps(report, indent=1, default=str))     # partial results survive a kill
        md_path.write_text(markdown(report))
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
