"""`python -m bench.compare`: every backend side by side on a shape suite, through the same tune/timing code as
kernels.mm, with the Inductor peer and kernels.mm itself.

    python -m bench.compare --backends aten,triton,cutlass,inductor --shapes square --dtype bf16 --json out.json

Without a GPU it says so and runs the Triton templates under the interpreter (TRITON_INTERPRET=1, set before
triton is imported) on small shapes: correctness only.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

# shapes larger than this (M*N*K) are too slow for the Triton interpreter / CPU
CPU_MAX_MACS = 1 << 21


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="aten,triton",
                   help="comma list: aten, triton, cutlass, template groups (triton_mm, triton_tma, decompose_k, "
                        "split_k, padded, cutlass3x, cutlass2x) and inductor; aten is always timed (default "
                        "%(default)s)")
    p.add_argument("--shapes", default="square", help="suite (tiny, square, llama, splitk, training, odd, core, "
                                                       "all; comma-joined) or a .csv/.json file of M,N,K")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32", "int8"),
                   help="int8 benchmarks int_mm (int8 x int8 -> int32)")
    p.add_argument("--layout", default="nn", choices=("nn", "nt", "tn", "tt"),
                   help="t = that operand column-major (A then B)")
    p.add_argument("--only", action="append", metavar="REGEX", help="keep only candidates whose name matches")
    p.add_argument("--skip", action="append", metavar="REGEX", help="drop candidates whose name matches")
    p.add_argument("--keep-going", action="store_true",
                   help="an unexpected error on one shape becomes a cell instead of stopping the run")
    p.add_argument("--no-kernels-mm", action="store_true", help="skip the kernels.mm vs torch.mm line")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--csv", metavar="PATH")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--bench-ms", type=float, default=None, help="measurement budget per candidate (KERNELS_BENCH_MS)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="start no new shape after S seconds; the rest are reported as skipped (JSON/CSV are "
                        "rewritten after every shape, so a killed run keeps what it measured)")
    return p


def ensure_interpreter_without_gpu(argv: list[str], module: str = "bench.compare") -> bool:
    """On a machine without CUDA, Triton can only run under its interpreter, and TRITON_INTERPRET must be set before
    triton is imported: set it now, or re-exec this command with it set when triton is already loaded.
    Returns True when the process runs without a GPU."""
    import torch
    if torch.cuda.is_available():
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
        os.environ["TRITON_INTERPRET"] = "1"
    return True


class Progress:
    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.start = time.perf_counter()

    def __call__(self, text: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.start:7.1f}s] {text}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace, no_gpu: bool, progress: Progress):
    """Measure every shape; returns the Report (partial if an error stopped the run) and the error, if any."""
    import torch

    from bench import measure as m
    from bench.columns import NameFilter, parse_columns, tuned_backends
    from bench.device import environment, measure_device
    from bench.results import Cell, Report, ShapeResult, summarize
    from bench.shapes import parse_shapes
    from kernels.core.config import config

    columns = parse_columns(args.backends)
    flt = NameFilter.compile(args.only, args.skip)
    shapes = parse_shapes(args.shapes, args.dtype)
    if args.bench_ms is not None:
        config.bench_budget_ms = args.bench_ms
    # --only/--skip also narrow the tuner's candidates (kernels.candidates), so filtered ones are never compiled
    config.only, config.skip = tuple(args.only or ()), tuple(args.skip or ())
    device = "cpu" if no_gpu else "cuda"
    if no_gpu:
        torch.set_num_threads(1)   # CPU numbers on a shared machine: no thread-pool contention
    progress("measuring device peak and copy bandwidth" if not no_gpu else
             "no CUDA GPU: Triton runs under the interpreter (TRITON_INTERPRET=1), times are CPU times, "
             "correctness only")
    facts = measure_device(args.dtype)
    if facts.peak_tflops:
        progress(f"{facts.name}: peak {facts.peak_tflops:.0f} T/s ({facts.peak_shape}), copy "
                 f"{facts.bandwidth_gbs:.0f} GB/s")
    backends_all = tuple(tuned_backends(columns))
    report = Report(args=vars(args), env=environment(), device=facts, columns=[c.name for c in columns],
                    shapes=[], mode="cpu-interpreter" if no_gpu else "gpu")
    if "cutlass" in backends_all and not no_gpu:
        report.prebuild = _prebuild(shapes, args, device, progress)
    if not args.no_kernels_mm and not no_gpu:
        import kernels

        # kernels.mm is timed in steady state: with the C++ warm-call table when it builds here (KERNELS_FASTPATH)
        progress(f"kernels.mm warm-call table: {kernels.load_fastpath()}")
        report.env["fastpath"] = kernels.fastpath_status()
    error = None
    for i, shape in enumerate(shapes, 1):
        where = f"[{i}/{len(shapes)}] {shape.label()} {args.dtype} {args.layout}"
        problem = m.problem_for(shape, args.dtype, args.layout, device)
        sr = ShapeResult(shape.m, shape.n, shape.k, problem.op, args.dtype, args.layout, problem.flops,
                         problem.min_bytes, facts.floor_ms(problem.flops, problem.min_bytes))
        report.shapes.append(sr)
        if args.time_limit is not None and time.perf_counter() - progress.start > args.time_limit:
            for c in columns:
                sr.cells[c.name] = Cell(c.name, "skipped", message=f"--time-limit {args.time_limit:.0f} s reached")
            progress(f"{where}: skipped (time limit)")
            continue
        if no_gpu and shape.macs > CPU_MAX_MACS:
            for c in columns:
                sr.cells[c.name] = Cell(c.name, "skipped", message=f"too large without a GPU (M*N*K > "
                                                                   f"{CPU_MAX_MACS}); try --shapes tiny")
            progress(f"{where}: skipped (no GPU)")
            continue
        try:
            _measure_shape(args, columns, flt, backends_all, problem, facts, sr, no_gpu, where, progress)
        except Exception as e:  # noqa: BLE001 - the report keeps what was measured; --keep-going continues
            sr.notes.append(f"error: {type(e).__name__}: {e}")
            for c in columns:
                sr.cells.setdefault(c.name, Cell(c.name, "error", message=f"{type(e).__name__}: {str(e)[:200]}"))
            progress(f"{where}: error {type(e).__name__}: {e}")
            if not args.keep_going:
                error = e
                break
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
            _save_partial(args, report, summarize)
    report.summary = summarize(report.columns, report.shapes)
    return report, error


def _prebuild(shapes, args, device, progress) -> dict:
    """The suite's CUTLASS kernels in one ninja batch before the first shape: a shape has a handful of candidates,
    so building per shape leaves most cores idle. Each shape's tune then loads them (its tune time excludes this)."""
    from bench import measure as m
    from kernels.tune.autotune import prebuild

    start = time.perf_counter()
    problems = [m.problem_for(s, args.dtype, args.layout, device) for s in shapes]
    progress(f"building the CUTLASS candidates of {len(problems)} shapes in one batch")
    compiled = prebuild(problems, ("cutlass",))
    seconds = time.perf_counter() - start
    progress(f"built {compiled.get('cutlass', 0)} CUTLASS kernels in {seconds:.0f} s")
    return {"seconds": round(seconds, 2), "compiled": compiled}


def _save_partial(args, report, summarize) -> None:
    """Rewrite the JSON/CSV after every shape: a run stopped from outside keeps what it measured."""
    from bench.report import write_csv, write_json

    report.summary = summarize(report.columns, report.shapes)
    if args.json:
        write_json(report, args.json)
    if args.csv:
        write_csv(report, args.csv)


def _measure_shape(args, columns, flt, backends_all, problem, facts, sr, no_gpu, where, progress) -> None:
    from bench import measure as m

    outcomes = {}
    compile_only = no_gpu and "cutlass" in backends_all      # no GPU: CUTLASS is built, not run
    for backend in backends_all:
        if compile_only and backend == "cutlass":
            continue
        tuned = ("aten",) if backend == "aten" else ("aten", backend)
        progress(f"{where}: tuning {'+'.join(tuned)}")
        out = m.tune_backends(problem, tuned)
        outcomes[backend] = out
        timed = sum(isinstance(t, float) for t in out.timings.values())
        progress(f"{where}: {backend} done in {out.seconds:.1f} s ({timed} timed, "
                 f"{len(out.timings) - timed} failed/unsupported)")
    # kernels.mm first: Inductor's compile leaves process state behind (dynamo, caches) that a host-bound call
    # feels, so it is measured before any torch.compile of this shape runs
    sets = None
    if not args.no_kernels_mm:
        mm_backends = backends_all if "aten" in backends_all else ("aten",) + backends_all
        if compile_only:
            mm_backends = tuple(b for b in mm_backends if b != "cutlass")
        for out in outcomes.values():
            if out.backends == mm_backends:
                m.seed_selection(out)    # kernels.mm serves this very tune instead of tuning again
        progress(f"{where}: kernels.mm with backends {','.join(mm_backends)} vs torch.mm")
        sets = m.rotated_sets(problem, problem.device)
        sr.kernels_mm = m.kernels_mm_result(problem, mm_backends, sets, _budget())
    for col in columns:
        if col.kind == "inductor":
            sets = sets or m.rotated_sets(problem, problem.device)
            progress(f"{where}: inductor compile (max-autotune-no-cudagraphs)")
            sr.cells[col.name] = m.inductor_cell(problem, sets, facts, _budget())
        elif compile_only and col.backend == "cutlass":
            progress(f"{where}: {col.name} compile-only (no GPU)")
            sr.cells[col.name] = m.cutlass_compile_cell(col, problem)
        else:
            sr.cells[col.name] = m.tuned_cell(col, outcomes[col.backend], problem, facts, flt, no_gpu)


def _budget() -> float:
    from kernels.core.config import config
    return config.bench_budget_ms


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    no_gpu = ensure_interpreter_without_gpu(argv)
    from bench.columns import ColumnError
    from bench.report import PlotError, print_table, write_csv, write_json, write_plot
    from bench.shapes import ShapesError
    progress = Progress(args.quiet)
    if no_gpu:
        print("No CUDA GPU found: running Triton templates under the interpreter on small shapes "
              "(correctness only; times are CPU times, not performance).", file=sys.stderr)
    try:
        report, error = run(args, no_gpu, progress)
    except (ColumnError, ShapesError, ValueError) as e:
        parser.error(str(e))
    print_table(report)
    if args.json:
        write_json(report, args.json)
        progress(f"wrote {args.json}")
    if args.csv:
        write_csv(report, args.csv)
        progress(f"wrote {args.csv}")
    rc = 0
    if args.plot:
        try:
            write_plot(report, args.plot)
            progress(f"wrote {args.plot}")
        except PlotError as e:
            print(f"plot not written: {e}", file=sys.stderr)
            rc = 2
    if error is not None:
        print(f"stopped after an error (use --keep-going to continue past it): {type(error).__name__}: {error}",
              file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
