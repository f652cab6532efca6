"""`python -m bench.sustained`: what a user gets from kernels.mm / int_mm / scaled_mm in a sustained loop (issue 27,
"Measured on the GPU"). Per problem: the first call's wall time (it tunes: the cost of a new problem), kernels
against torch in back-to-back loops, and the selection's regret against the finalists of its final round re-timed
the same way, with a check that the tuner's final-round times rank those finalists as the loops do.

    python -m bench.sustained --json sustained.jsonl
    python -m bench.sustained --problems bf16:4096x4096x4096:nn,int8:1024x22016x4096:nt --backends aten,triton,cutlass
    python -m bench.sustained --set issue30          # fp8: kernels.scaled_mm vs torch._scaled_mm, both scalings
    python -m bench.sustained --table-from sustained.jsonl          # the table of a saved run, no GPU needed

A loop runs one call back to back for --seconds on rotating input sets of the problem's layout (enough sets that L2
does not hold them) and yields the mean ms per call over its last second, timed with CUDA events; the GPU is not
idled between calls or loops. Variants run alternated, A B A B ..., in one process, --rounds times each; a variant's
time is the median (or --stat min) over its rounds, the same statistic for every variant, and every round is in the
JSON. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

import kernels
from bench.cli_common import RunFileError, non_negative, positive
from bench.device import environment
from bench.measure import (FP8, FP8_LAYOUT, LAYOUTS, finish_duels, layout_error, op_for, problem_for, shape_error,
                           user_calls)
from bench.progress import RunProgress
from bench.shapes import FP8_SUITES, Shape
from bench.sustained_report import (HEADERS, STATS, TIMED_S, ProblemResult, finalists, print_table,
                                    read_run, table_row, table_title)
from kernels.core.config import config
from kernels.core.errors import SettingError
from kernels.core.problem import SCALINGS
from kernels.core.selection import Selection
from kernels.dispatch.dynamic import build_launch
from kernels.measure.timing import user_call
from kernels.measure.verify import make_inputs, timing_sets

DTYPES = ("bf16", "fp16", "fp32", "int8", "e4m3")
FP8_DTYPE = "e4m3"        # what bench.compare's --dtype fp8 runs; a spec may say fp8 for it too
PACE_CALLS = 8            # an event every this many calls ...
PACE_DEPTH = 4            # ... and the host waits for the one this many events back: the queue stays bounded, never empty


class SpecError(ValueError):
    """A problem, set or option that cannot be run; the message says what is allowed."""


@dataclass(frozen=True)
class ProblemSpec:
    dtype: str
    m: int
    n: int
    k: int
    layout: str = "nn"        # A then B: n row-major, t column-major (nt: B = w.t() of an (N, K) weight)
    scaling: str = ""         # e4m3 (scaled_mm): "tensor" or "row" scales; "" for the other dtypes

    @property
    def op(self) -> str:
        return op_for(self.dtype)

    def label(self) -> str:
        return " ".join(p for p in (self.dtype, f"{self.m}x{self.n}x{self.k}", self.layout, self.scaling) if p)


_BF16 = [("bf16", d, "nn") for d in ("4096x4096x4096", "6144x6144x6144", "8192x8192x8192", "4096x4096x14336",
                                       "12288x12288x128")]
_BF16_NT = [("bf16", d, "nt") for d in ("4096x11008x4096", "8192x14336x4096", "8192x4096x14336")]
_INT8_NT = [("int8", d, "nt") for d in ("1024x22016x4096", "4096x4096x4096")]


def _fp8(scaling: str) -> list[tuple[str, ...]]:
    """Issue 30's problems (bench.shapes' fp8 suite, the one bench.compare --dtype fp8 runs) with these scales."""
    return [(FP8_DTYPE, s.label(), FP8_LAYOUT, scaling) for s in FP8_SUITES["fp8"]]


SETS = {
    "issue27": _BF16 + _BF16_NT + _INT8_NT,            # issue 27's "Measured on the GPU" problems
    "issue27-bf16": _BF16 + _BF16_NT,
    "issue27-int8": _INT8_NT,
    "issue30": _fp8("tensor") + _fp8("row"),           # issue 30's fp8 problems, per-tensor then row-wise scales
    "issue30-tensor": _fp8("tensor"),
    "issue30-row": _fp8("row"),
    "smoke": [("bf16", "4096x11008x4096", "nt"), ("int8", "4096x4096x4096", "nt")],
}
FORMAT = "dtype:MxNxK[:layout[:scaling]]"


def parse_problem(text: str) -> ProblemSpec:
    """`dtype:MxNxK[:layout[:scaling]]`: layout nn when left out (e4m3: nt, the only one it takes); scaling tensor or
    row for e4m3 (tensor when left out), none for the other dtypes."""
    parts = [p.strip().lower() for p in text.strip().split(":")]
    if len(parts) not in (2, 3, 4):
        raise SpecError(f"problem {text!r}: expected {FORMAT}, e.g. bf16:4096x11008x4096:nt or "
                        f"e4m3:16x12288x4096:nt:row")
    dtype = FP8_DTYPE if parts[0] == FP8 else parts[0]
    if dtype not in DTYPES:
        raise SpecError(f"problem {text!r}: unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)} ({FP8} = "
                        f"{FP8_DTYPE})")
    fp8 = dtype == FP8_DTYPE
    layout = parts[2] if len(parts) > 2 else FP8_LAYOUT if fp8 else "nn"
    if layout not in LAYOUTS:
        raise SpecError(f"problem {text!r}: unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
    sizes = parts[1].split("x")
    if len(sizes) != 3 or not all(s.isdigit() and int(s) > 0 for s in sizes):
        raise SpecError(f"problem {text!r}: sizes must be MxNxK, three positive integers")
    shape = Shape(*(int(s) for s in sizes))
    why = layout_error(dtype, layout) or shape_error(shape, dtype)
    if why:
        raise SpecError(f"problem {text!r}: {why}")
    return ProblemSpec(dtype, shape.m, shape.n, shape.k, layout, _scaling(text, dtype, parts[3:]))


def _scaling(text: str, dtype: str, given: list[str]) -> str:
    """The spec's scaling: e4m3's (tensor unless given), none for other dtypes."""
    if dtype != FP8_DTYPE:
        if given:
            raise SpecError(f"problem {text!r}: a scaling ({given[0]!r}) is for {FP8_DTYPE} only")
        return ""
    scaling = given[0] if given else "tensor"
    if scaling not in SCALINGS:
        raise SpecError(f"problem {text!r}: unknown scaling {scaling!r}; allowed: {', '.join(SCALINGS)}")
    return scaling


def parse_problems(text: str) -> list[ProblemSpec]:
    specs = [parse_problem(p) for p in text.split(",") if p.strip()]
    if not specs:
        raise SpecError("--problems names no problem")
    return list(dict.fromkeys(specs))


def problem_set(name: str) -> list[ProblemSpec]:
    if name not in SETS:
        raise SpecError(f"unknown set {name!r}; sets: {', '.join(SETS)}")
    return [parse_problem(":".join(entry)) for entry in SETS[name]]


# -- the loops on the GPU -------------------------------------------------------------------------------------------
Call = Callable[[int], object]
# (call, number of input sets, seconds) -> a reader of ms per call over the loop's timed tail, read after the round
LoopRunner = Callable[[Call, int, float], Callable[[], float]]


def cuda_loop(call: Call, n_sets: int, seconds: float) -> Callable[[], float]:
    """Run `call` back to back for `seconds`, timing its last TIMED_S with CUDA events. The host runs ahead of the
    GPU by at most PACE_DEPTH * PACE_CALLS calls (it waits on an older event, never synchronizes the device), so the
    GPU does not idle between calls, nor between this loop and the next one."""
    pace: deque = deque()
    count = 0

    def one() -> None:
        nonlocal count
        call(count % n_sets)
        count += 1
        if count % PACE_CALLS == 0:
            ev = torch.cuda.Event()
            ev.record()
            pace.append(ev)
            if len(pace) > PACE_DEPTH:
                pace.popleft().synchronize()

    timed_s = min(TIMED_S, seconds)
    untimed_until = time.perf_counter() + seconds - timed_s
    while time.perf_counter() < untimed_until:
        one()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    first = count
    until = time.perf_counter() + timed_s
    one()
    while time.perf_counter() < until:
        one()
    end.record()
    calls = count - first

    def read() -> float:
        end.synchronize()
        return start.elapsed_time(end) / calls
    return read


def alternate(variants: dict[str, Call], n_sets: int, rounds: int, seconds: float,
              runner: LoopRunner = cuda_loop) -> dict[str, list[float]]:
    """Each variant's loop, A B A B ..., `rounds` times; ms per call per round, read after the last loop."""
    readers: dict[str, list] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, call in variants.items():
            readers[name].append(runner(call, n_sets, seconds))
    return {name: [read() for read in rs] for name, rs in readers.items()}


@dataclass(frozen=True)
class LoopPlan:
    """How each variant is looped: --seconds per loop, --rounds alternated, --heat before the first round."""
    seconds: float = 1.5
    rounds: int = 2
    heat: float = 1.0
    stat: str = "median"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _finalist_calls(selection: Selection, names: list[str], sets, device: str,
                    result: ProblemResult) -> dict[str, Call]:
    """A direct call per finalist, through the launch the dispatcher would build for it; one that cannot be built
    or run is recorded as a failure, not looped."""
    calls = {}
    for name in names:
        launch, why = build_launch(selection.problem, selection.choices[name])
        if launch is None:
            result.finalist_failures[name] = why
            continue
        call = user_call(launch, sets)
        try:
            call(0)
            _sync(device)
        except Exception as e:  # noqa: BLE001 - one broken finalist must not cost the problem
            result.finalist_failures[name] = f"{type(e).__name__}: {str(e)[:300]}"
            continue
        calls[name] = call
    return calls


def measure_problem(spec: ProblemSpec, plan: LoopPlan, progress: RunProgress, device: str = "cuda",
                    runner: LoopRunner = cuda_loop) -> ProblemResult:
    """The first call (timed: it tunes), kernels vs torch alternated, then the finalists alternated, all on the same
    rotating input sets. `device`/`runner` other than cuda's serve the interpreter test on CPU."""
    result = ProblemResult(spec.label(), spec.dtype, "ok", stat=plan.stat, seconds=plan.seconds,
                           scaling=spec.scaling)
    problem = problem_for(Shape(spec.m, spec.n, spec.k), spec.dtype, spec.layout, device, spec.scaling)
    first = make_inputs(problem, device, seed=0)
    sets = timing_sets(problem, device, first, seed=1)
    calls = user_calls(problem)
    user_fn, torch_fn = calls.kernels, calls.torch

    progress.step(f"{spec.label()}: first call")
    tunes = kernels.stats()["tunes"]
    _sync(device)
    start = time.perf_counter()
    user_fn(*first)
    _sync(device)
    result.first_call_s = time.perf_counter() - start
    result.tuned = kernels.stats()["tunes"] > tunes
    duels = finish_duels(lambda: user_fn(*first), device, every=20,    # the loops time the winner, not the duel
                         pending=lambda: calls.explain(*first).awaiting_calls)
    result.duel_s, result.duel_calls = duels.seconds, duels.calls
    selection = calls.explain(*first)
    result.winner, result.tune_s = selection.winner, selection.tune_seconds
    regime = getattr(selection, "regime", None)               # where the tuner records which regime chose
    result.regime = None if regime is None else str(regime)
    result.unavailable, result.notes = list(selection.unavailable), list(selection.notes)

    progress.step(f"{spec.label()}: kernels vs torch loops")
    variants = {"kernels": lambda i: user_fn(*sets[i]), "torch": lambda i: torch_fn(*sets[i])}
    if plan.heat > 0:
        runner(variants["torch"], len(sets), plan.heat)    # unread: the first round starts on a warm chip
    loops = alternate(variants, len(sets), plan.rounds, plan.seconds, runner)
    result.kernels_rounds_ms, result.torch_rounds_ms = loops["kernels"], loops["torch"]

    names, result.tuner_ms, result.finalist_source = finalists(selection)
    progress.step(f"{spec.label()}: {len(names)} finalists' loops")
    finalist_calls = _finalist_calls(selection, names, sets, device, result)
    if len(finalist_calls) >= 2:
        result.finalist_rounds_ms = alternate(finalist_calls, len(sets), plan.rounds, plan.seconds, runner)
    return result


# -- the command ----------------------------------------------------------------------------------------------------
def _rounds(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: at least 2 rounds (the variants alternate)")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.sustained", description=__doc__.split("\n\n")[0])
    p.add_argument("--problems", help=f"comma list of {FORMAT} (dtype: " + ", ".join(DTYPES) + "; layout: " +
                   ", ".join(LAYOUTS) + ", default nn; e4m3 (or fp8) is kernels.scaled_mm vs torch._scaled_mm "
                   "(bf16 out), layout nt only, scaling tensor (default) or row), e.g. bf16:4096x11008x4096:nt, "
                   "e4m3:16x12288x4096:nt:row")
    p.add_argument("--set", dest="problem_set", help=f"a named set: {', '.join(SETS)} (default issue27)")
    p.add_argument("--backends", help="KERNELS_BACKENDS for this run (kernels.config.backends), e.g. "
                   "aten,triton,padded,cutlass (default: the environment's, else kernels' default)")
    p.add_argument("--seconds", type=positive, default=1.5,
                   help=f"length of each loop; its last {TIMED_S:g} s is timed (default %(default)s)")
    p.add_argument("--rounds", type=_rounds, default=2, help="loops per variant, alternated (default %(default)s)")
    p.add_argument("--heat", type=non_negative, default=1.0,
                   help="seconds of torch's call before a problem's first round (default %(default)s)")
    p.add_argument("--stat", choices=tuple(STATS), default="median",
                   help="a variant's time over its rounds (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="JSON lines: a run header, then one line per problem as it ends")
    p.add_argument("--time-limit", type=positive, metavar="S",
                   help="start no new problem after S seconds (the rest are recorded as skipped)")
    p.add_argument("--table-from", metavar="PATH", help="print the table of a saved --json run and exit (no GPU)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def resolve(argv: list[str]) -> argparse.Namespace:
    """Parsed and checked arguments, with `specs` (the problems) and `plan` (the loops); exit 2 with a usage error
    otherwise. --backends is applied here to kernels.config, for the whole run."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.problems and args.problem_set:
            raise SpecError("give --problems or --set, not both")
        args.specs = parse_problems(args.problems) if args.problems else problem_set(args.problem_set or "issue27")
        if args.backends is not None:
            config.backends = args.backends
    except (SpecError, SettingError) as e:
        parser.error(str(e))
    args.plan = LoopPlan(args.seconds, args.rounds, args.heat, args.stat)
    return args


def run(args: argparse.Namespace, progress: RunProgress, emit: Callable[[dict], None], device: str = "cuda",
        runner: LoopRunner = cuda_loop) -> tuple[dict, list]:
    """Every problem in turn, each record passed to `emit` as soon as it exists; returns the header and results.
    `device`/`runner` other than cuda's serve the interpreter test on CPU."""
    header = {"kind": "run", "backends": ",".join(config.backends), **asdict(args.plan), "timed_s": TIMED_S,
              "problems": [s.label() for s in args.specs], "fastpath": kernels.load_fastpath(), **environment()}
    emit(header)
    progress.note(f"{header['gpu']}: backends {header['backends']}; warm calls: {header['fastpath']}")
    results = []
    with progress:
        for spec in args.specs:
            if args.time_limit is not None and progress.elapsed > args.time_limit:
                result = ProblemResult(spec.label(), spec.dtype, "skipped", scaling=spec.scaling,
                                       message=f"--time-limit {args.time_limit:g} s reached")
            else:
                try:
                    result = measure_problem(spec, args.plan, progress, device, runner)
                except KeyboardInterrupt:       # the table of what was measured still prints
                    results.append(ProblemResult(spec.label(), spec.dtype, "skipped", scaling=spec.scaling,
                                                 message="interrupted"))
                    break
                except Exception as e:  # noqa: BLE001 - the run goes on; the error is the problem's record
                    result = ProblemResult(spec.label(), spec.dtype, "error", scaling=spec.scaling,
                                           message=f"{type(e).__name__}: {e}")
                finally:
                    torch.cuda.empty_cache()
            results.append(result)
            emit(result.to_json())
            progress.note(summary_line(result))
            progress.advance()
    return header, results


def summary_line(r: ProblemResult) -> str:
    row = dict(zip(HEADERS, table_row(r)))
    if r.status != "ok":
        return f"{r.problem}: {row['winner']}"
    return (f"{r.problem}: {r.winner}, first call {row['tune s']} s; kernels {row['kernels ms']} ms, torch "
            f"{row['torch ms']} ms: {row['speedup']}; regret {row['regret']}; regime agrees {row['regime agrees']}")


def _error(text: str) -> int:
    print(f"python -m bench.sustained: error: {text}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = resolve(list(sys.argv[1:] if argv is None else argv))
    if args.table_from:
        try:
            header, results = read_run(args.table_from)
        except (OSError, RunFileError) as e:
            return _error(str(e))
        print_table(results, table_title(header))
        return 0
    if not torch.cuda.is_available():
        return _error("it measures on a CUDA GPU and torch sees none here (--table-from PATH prints a saved run "
                      "without one)")
    with contextlib.ExitStack() as stack:
        try:
            out = stack.enter_context(open(args.json, "w")) if args.json else None
        except OSError as e:
            return _error(f"--json {args.json}: {e}")

        def emit(record: dict) -> None:          # flushed per line: a killed run keeps what it measured
            if out is not None:
                out.write(json.dumps(record, default=str) + "\n")
                out.flush()
        progress = RunProgress(len(args.specs), quiet=args.quiet)
        header, results = run(args, progress, emit)
    print_table(results, table_title(header))
    if args.json:
        progress.note(f"wrote {args.json}")
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
