"""`python -m bench.compare`: every backend side by side on a shape suite, through the same tune/timing code as
kernels.mm, with the Inductor peer and kernels.mm itself.

Each backend is tuned on its own; then each row (aten, every column's best candidate, kernels.mm, Inductor) is
measured together in the tuner's steady final-round regime (bench.row), and that is what the table prints: every
time is the median of its windows, every spread comes from the same windows, every ratio is aten's printed time over
the cell's. The tunes' own numbers stay in the JSON (`tune_timing`).

    python -m bench.compare --backends aten,triton,cutlass,inductor --shapes square --dtype bf16 --json out.json
    python -m bench.compare --dtype fp8 --scaling row --backends aten,triton,cutlass,padded,inductor

--dtype fp8 benchmarks kernels.scaled_mm against torch._scaled_mm (e4m3 x e4m3, bf16 out, B column-major: the nt
layout, the only one fp8 takes) on issue 30's problems (suite fp8), with per-tensor (default) or row-wise scales.

Without a GPU it says so and checks correctness only: the Triton templates run under the interpreter
(TRITON_INTERPRET=1, set before triton is imported) on tiny fp16 shapes, every candidate against a float64 reference,
and nothing is reported as a speed (no speedups, no geomean); CUTLASS, when asked for, is compiled for sm90, not run.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import kernels
from bench import measure as m
from bench.cli_common import non_negative, output_file, positive
from bench.columns import ColumnError, NameFilter, parse_columns, tuned_backends
from bench.device import environment, measure_device
from bench.progress import RunProgress
from bench.report import PLOT_INSTALL, PlotError, print_table, pyplot, write_csv, write_json, write_plot
from bench.results import ENTRY_NAMES, Cell, Report, ShapeResult, summarize
from bench.row import KERNELS_MM, RowCalls, apply_row, measure_row
from bench.shapes import ShapesError, parse_shapes
from kernels.tune.autotune import prebuild
from kernels.core.config import config
from kernels.measure.steady import plan_for
from kernels.core.problem import SCALINGS
from kernels.space.shapes import COMPARE_LAYOUT, COMPARE_SUITE

# shapes larger than this (M*N*K) are too slow for the Triton interpreter / CPU
CPU_MAX_MACS = 1 << 21
# (shapes, dtype) when not given: a GPU runs the real comparison; without one, the interpreter checks tiny shapes in
# fp16 (its bf16 tl.dot gives wrong results, triton issue #11584)
GPU_DEFAULTS = (COMPARE_SUITE, "bf16")   # the default CUTLASS set (kernels.tune.warmup) is built for these
NO_GPU_DEFAULTS = ("tiny", "fp16")
# --dtype fp8's shapes when --shapes is not given: issue 30's problems on a GPU, tiny ones without (bench.shapes)
FP8_SHAPES = {False: "fp8", True: "tiny-fp8"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="aten,triton",
                   help="comma list: aten, triton, cutlass, template groups (triton_mm, triton_scaled_mm, "
                        "triton_tma, decompose_k, split_k, padded, cutlass3x, cutlass2x) and inductor; aten is always "
                        "timed (default %(default)s). Without a GPU, cutlass is compiled for sm90 but not run")
    p.add_argument("--shapes", default=None,
                   help="suite (tiny, square, llama, splitk, training, odd, core, all, fp8, tiny-fp8; comma-joined) "
                        f"or a .csv/.json file of M,N,K (default {GPU_DEFAULTS[0]} on a GPU, {NO_GPU_DEFAULTS[0]} "
                        f"without one; with --dtype fp8: {FP8_SHAPES[False]}, {FP8_SHAPES[True]} without a GPU)")
    p.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32", "int8", m.FP8),
                   help=f"operand dtype; int8 benchmarks int_mm (int8 x int8 -> int32), fp8 scaled_mm (e4m3 x e4m3 "
                        f"with fp32 scales -> bf16, against torch._scaled_mm; K and N multiples of 16) (default "
                        f"{GPU_DEFAULTS[1]} on a GPU, {NO_GPU_DEFAULTS[1]} without one: the Triton interpreter's bf16 "
                        f"dot is wrong)")
    p.add_argument("--layout", default=None, choices=m.LAYOUTS,
                   help=f"t = that operand column-major (A then B) (default {COMPARE_LAYOUT}; fp8 takes "
                        f"{m.FP8_LAYOUT} only)")
    p.add_argument("--scaling", default=None, choices=SCALINGS,
                   help="fp8's scales: tensor (one fp32 each) or row (scale_a (M, 1), scale_b (1, N)) (default "
                        "tensor)")
    p.add_argument("--only", action="append", metavar="REGEX", help="keep only candidates whose name matches")
    p.add_argument("--skip", action="append", metavar="REGEX", help="drop candidates whose name matches")
    p.add_argument("--keep-going", action="store_true",
                   help="an unexpected error on one shape becomes a cell instead of stopping the run")
    p.add_argument("--no-kernels-mm", action="store_true",
                   help="skip the kernels.mm vs torch.mm line (kernels.int_mm, kernels.scaled_mm for int8, fp8)")
    p.add_argument("--json", metavar="PATH", type=output_file,
                   help="write the whole report (environment, device, every cell) as JSON")
    p.add_argument("--csv", metavar="PATH", type=output_file, help="write one row per shape and column as CSV")
    p.add_argument("--plot", metavar="PNG", type=output_file,
                   help=f"write a bar chart (TFLOP/s per column; without a GPU, candidates verified); needs "
                        f"matplotlib: {PLOT_INSTALL}")
    p.add_argument("--bench-ms", type=positive, default=None,
                   help="tuning's measurement budget per candidate (KERNELS_BENCH_MS); each row's measurement "
                        "together afterwards follows the steady regime's own plan")
    p.add_argument("--quiet", action="store_true",
                   help="no progress bar and no notes on stderr (the bar is shown only when stderr is a terminal)")
    p.add_argument("--time-limit", type=non_negative, default=None, metavar="S",
                   help="start no new shape after S seconds; the rest are reported as skipped (JSON/CSV are "
                        "rewritten after every shape, so a killed run keeps what it measured)")
    return p


def resolve_defaults(args: argparse.Namespace, no_gpu: bool) -> argparse.Namespace:
    """Fill --shapes, --dtype, --layout and --scaling left out: the real comparison on a GPU, the interpreter's small
    check without; fp8 has its own shapes, its one layout and per-tensor scales by default. A layout or scaling the
    dtype does not take is a ValueError naming the option."""
    shapes, dtype = NO_GPU_DEFAULTS if no_gpu else GPU_DEFAULTS
    args.dtype = args.dtype or dtype
    fp8 = args.dtype == m.FP8
    args.shapes = args.shapes or (FP8_SHAPES[no_gpu] if fp8 else shapes)
    args.layout = args.layout or (m.FP8_LAYOUT if fp8 else COMPARE_LAYOUT)
    why = m.layout_error(args.dtype, args.layout)
    if why:
        raise ValueError(f"--layout {args.layout}: {why}")
    if args.scaling and not fp8:
        raise ValueError(f"--scaling {args.scaling}: scales are for --dtype fp8 only, not {args.dtype}")
    args.scaling = args.scaling or ("tensor" if fp8 else "")
    return args


def ensure_interpreter_without_gpu(argv: list[str], module: str = "bench.compare") -> bool:
    """On a machine without CUDA, Triton can only run under its interpreter, and TRITON_INTERPRET must be set before
    triton is imported: set it now, or re-exec this command with it set when triton is already loaded.
    Returns True when the process runs without a GPU."""
    if torch.cuda.is_available():
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            env = dict(os.environ, TRITON_INTERPRET="1")
            os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)
        os.environ["TRITON_INTERPRET"] = "1"
    return True


def no_gpu_banner(args: argparse.Namespace) -> str:
    """What a run without a GPU does, said before it starts."""
    lines = [f"No GPU: a correctness-only run. Triton templates run through the Triton interpreter on CPU tensors "
             f"(shapes {args.shapes}, {args.dtype}) and every candidate is checked against a float64 reference; CPU "
             f"times say nothing about a GPU, so no speedups are printed."]
    if "cutlass" in tuned_backends(parse_columns(args.backends)):
        lines.append("CUTLASS: compile-only (its best-ranked candidate is built for sm90 with nvcc, about 45 s on "
                     "2 cores; nothing runs).")
    try:
        too_large = [s for s in parse_shapes(args.shapes, args.dtype) if s.macs > CPU_MAX_MACS]
    except ShapesError:
        too_large = []        # run() reports the bad --shapes as a usage error
    if too_large:
        lines.append(f"{len(too_large)} shape(s) of --shapes {args.shapes} are too large for the interpreter "
                     f"(M*N*K > {CPU_MAX_MACS}) and will be skipped; --shapes tiny checks correctness.")
    if args.dtype == "bf16":
        lines.append("bf16: the Triton interpreter's bf16 dot gives wrong results (triton issue #11584), so Triton "
                     "candidates fail verification here; --dtype fp16 checks them.")
    return "\n".join(lines)


def run(args: argparse.Namespace, no_gpu: bool, progress: RunProgress):
    """Measure every shape; returns the Report (partial if an error stopped the run) and the error, if any."""
    columns = parse_columns(args.backends)
    flt = NameFilter.compile(args.only, args.skip)
    shapes = parse_shapes(args.shapes, args.dtype)
    for shape in shapes:
        why = m.shape_error(shape, args.dtype)
        if why:
            raise ShapesError(f"--shapes {args.shapes}: {why}")
    progress.total = len(shapes)
    if args.bench_ms is not None:
        config.bench_budget_ms = args.bench_ms
    # --only/--skip also narrow the tuner's candidates (kernels.tune.candidates), so filtered ones are never compiled
    config.only, config.skip = tuple(args.only or ()), tuple(args.skip or ())
    device = "cpu" if no_gpu else "cuda"
    if no_gpu:
        torch.set_num_threads(1)   # CPU numbers on a shared machine: no thread-pool contention
    else:
        progress.note("measuring device peak and copy bandwidth")
    facts = measure_device(args.dtype)
    if facts.peak_tflops:
        progress.note(f"{facts.name}: peak {facts.peak_tflops:.0f} T/s ({facts.peak_shape}), copy "
                      f"{facts.bandwidth_gbs:.0f} GB/s")
    backends_all = tuple(tuned_backends(columns))
    report = Report(args=vars(args), env=environment(), device=facts, columns=[c.name for c in columns],
                    shapes=[], mode="cpu-interpreter" if no_gpu else "gpu")
    if "cutlass" in backends_all and not no_gpu:
        report.prebuild = _prebuild(shapes, args, device, progress)
    if not args.no_kernels_mm and not no_gpu:
        # kernels.mm is timed as users call it: with the C++ warm-call table when it builds here (KERNELS_FASTPATH)
        progress.note(f"kernels.mm warm-call table: {kernels.load_fastpath()}")
        report.env["fastpath"] = kernels.fastpath_status()
    error = None
    with progress:
        for shape in shapes:
            problem = m.problem_for(shape, args.dtype, args.layout, device, args.scaling)
            sr = ShapeResult(shape.m, shape.n, shape.k, problem.op, args.dtype, args.layout, problem.flops,
                             problem.min_bytes, facts.floor_ms(problem.flops, problem.min_bytes),
                             scaling=args.scaling)
            where = sr.heading()
            report.shapes.append(sr)
            if args.time_limit is not None and progress.elapsed > args.time_limit:
                for c in columns:
                    sr.cells[c.name] = Cell(c.name, "skipped",
                                            message=f"--time-limit {args.time_limit:.0f} s reached")
                progress.advance()
                continue
            if no_gpu and shape.macs > CPU_MAX_MACS:
                for c in columns:
                    sr.cells[c.name] = Cell(c.name, "skipped", message=f"too large without a GPU (M*N*K > "
                                                                       f"{CPU_MAX_MACS}); try --shapes tiny")
                progress.advance()
                continue
            try:
                _measure_shape(args, columns, flt, backends_all, problem, facts, sr, no_gpu, where, progress)
            except Exception as e:  # noqa: BLE001 - the report keeps what was measured; --keep-going continues
                sr.notes.append(f"error: {type(e).__name__}: {e}")
                for c in columns:
                    sr.cells.setdefault(c.name, Cell(c.name, "error", message=f"{type(e).__name__}: {str(e)[:200]}"))
                progress.note(f"{where}: error {type(e).__name__}: {e}")
                if not args.keep_going:
                    error = e
                    break
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
                _save_partial(args, report)
            progress.advance()
    report.summary = summarize(report.columns, report.shapes, speed=report.speed)
    return report, error


def _prebuild(shapes, args, device, progress: RunProgress) -> dict:
    """The suite's CUTLASS kernels in one ninja batch before the first shape: a shape has a handful of candidates,
    so building per shape leaves most cores idle. Each shape's tune then loads them (its tune time excludes this)."""
    start = time.perf_counter()
    problems = [m.problem_for(s, args.dtype, args.layout, device, args.scaling) for s in shapes]
    progress.note(f"building the CUTLASS candidates of {len(problems)} shapes in one batch")
    compiled = prebuild(problems, ("cutlass",))
    seconds = time.perf_counter() - start
    progress.note(f"built {compiled.get('cutlass', 0)} CUTLASS kernels in {seconds:.0f} s")
    return {"seconds": round(seconds, 2), "compiled": compiled}


def _save_partial(args, report: Report) -> None:
    """Rewrite the JSON/CSV after every shape: a run stopped from outside keeps what it measured."""
    report.summary = summarize(report.columns, report.shapes, speed=report.speed)
    if args.json:
        write_json(report, args.json)
    if args.csv:
        write_csv(report, args.csv)


def _measure_shape(args, columns, flt, backends_all, problem, facts, sr, no_gpu, where,
                   progress: RunProgress) -> None:
    """Tune each column's backend, make kernels.mm's first call and Inductor's compile, then measure the whole row
    together in one steady regime (bench.row): the printed times and ratios of a row come from the same windows."""
    outcomes = {}
    compile_only = no_gpu and "cutlass" in backends_all      # no GPU: CUTLASS is built, not run
    for backend in backends_all:
        if compile_only and backend == "cutlass":
            continue
        tuned = ("aten",) if backend == "aten" else ("aten", backend)
        progress.step(f"{where}: tuning {'+'.join(tuned)}")
        outcomes[backend] = m.tune_backends(problem, tuned)
    sets = m.rotated_sets(problem, problem.device)
    row = RowCalls()
    # kernels.mm's first call before Inductor's compile: that leaves process state behind (dynamo, caches), and the
    # first call may tune
    if not args.no_kernels_mm:
        mm_backends = backends_all if "aten" in backends_all else ("aten",) + backends_all
        if compile_only:
            mm_backends = tuple(b for b in mm_backends if b != "cutlass")
        for out in outcomes.values():
            if out.backends == mm_backends:
                m.seed_selection(out)    # kernels.mm serves this very tune instead of tuning again
        progress.step(f"{where}: {ENTRY_NAMES[problem.op][0]} with backends {','.join(mm_backends)}")
        sr.kernels_mm, mm_call = m.kernels_mm_result(problem, mm_backends, sets)
        if mm_call is not None:
            row.add(KERNELS_MM, KERNELS_MM, lambda: mm_call)
    for col in columns:
        if col.kind == "inductor":
            progress.step(f"{where}: inductor compile (max-autotune-no-cudagraphs)")
            sr.cells[col.name], compiled = m.inductor_cell(problem, sets)
            if compiled is not None:
                row.add(col.name, col.name, lambda: compiled)
        elif compile_only and col.backend == "cutlass":
            progress.step(f"{where}: {col.name} compile-only (no GPU)")
            sr.cells[col.name] = m.cutlass_compile_cell(col, problem)
        else:
            cell = sr.cells[col.name] = m.tuned_cell(col, outcomes[col.backend], problem, facts, flt, no_gpu)
            if cell.ok:
                choice = outcomes[col.backend].choices[cell.best]
                row.add(cell.best, col.name, lambda: m.candidate_call(choice, problem, sets))
                if col.backend == "aten":
                    row.reference = cell.best       # aten: the baseline of every ratio on the row
    progress.step(f"{where}: measuring {len(row.calls)} calls together (steady regime)")
    result = measure_row(row, len(sets), problem.device)
    apply_row(sr, row, result, plan_for(problem.device).as_dict(), speed=not no_gpu)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:
        try:
            pyplot()        # before any work: a missing matplotlib must not cost a whole run
        except PlotError as e:
            print(f"{parser.prog}: error: {e}", file=sys.stderr)
            return 2
    no_gpu = ensure_interpreter_without_gpu(argv)
    try:
        resolve_defaults(args, no_gpu)
    except ValueError as e:
        parser.error(str(e))
    progress = RunProgress(0, quiet=args.quiet)
    try:
        if no_gpu:
            print(no_gpu_banner(args), file=sys.stderr, flush=True)
        report, error = run(args, no_gpu, progress)
    except (ColumnError, ShapesError, ValueError) as e:
        parser.error(str(e))
    print_table(report)
    if args.json:
        write_json(report, args.json)
        progress.note(f"wrote {args.json}")
    if args.csv:
        write_csv(report, args.csv)
        progress.note(f"wrote {args.csv}")
    rc = 0
    if args.plot:
        try:
            write_plot(report, args.plot)
            progress.note(f"wrote {args.plot}")
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
