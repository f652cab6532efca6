"""Measuring one shape: tune each backend with kernels.autotune.tune, compile the Inductor peer, make kernels.mm's
first call; and the calls bench.row then measures together (each column's best candidate, rebuilt from the artifact
store; kernels.mm; Inductor). Every failure becomes a Cell, never an exception out of here (unless the caller asked
not to keep going)."""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels
from backends import get_backend
from backends.aten import int_mm_limits
from bench.columns import Column, NameFilter, pick_best
from bench.results import Cell, DeviceFacts, KernelsMmResult, TuneTiming, rates
from bench.shapes import Shape
from kernels.tune.autotune import fingerprint, tune
from kernels.store.selections import SelectionStore, store_key
from kernels.core.config import config
from kernels.core.errors import NoCandidateError
from kernels.core.problem import DTYPES_BY_NAME, SCALED_MULTIPLE, SCALINGS, GemmProblem, op_of
from kernels.core.selection import Selection
from kernels.measure.timing import Call, user_call
from kernels.measure.verify import check, fresh_timing_sets, reference

LAYOUTS = ("nn", "nt", "tn", "tt")
# the benches' name for e4m3 x e4m3 products with scales (kernels.scaled_mm against torch._scaled_mm)
FP8 = "fp8"
# fp8 operands are K-major, as torch._scaled_mm and Hopper's fp8 tensor cores take them: A row-major, B column-major
FP8_LAYOUT = "nt"
SCALED_OUT_DTYPE = "bf16"      # what the benches ask of scaled_mm (torch._scaled_mm(..., out_dtype=torch.bfloat16))


def operand_dtype(dtype: str) -> str:
    """The GemmProblem dtype a bench dtype name stands for (fp8 -> e4m3; the others are that name)."""
    return "e4m3" if dtype == FP8 else dtype


def op_for(dtype: str) -> str:
    """mm, int_mm or scaled_mm: the op whose operands have this dtype (kernels.core.problem.OPS)."""
    return op_of(operand_dtype(dtype))


def layout_error(dtype: str, layout: str) -> str:
    """'' when a bench can make the dtype's operands in this layout, else why not (naming the option to change)."""
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if op_for(dtype) == "scaled_mm" and layout != FP8_LAYOUT:
        return (f"fp8 takes A row-major and B column-major only (layout {FP8_LAYOUT}, torch._scaled_mm's rule), "
                f"not {layout}")
    return ""


def shape_error(shape: Shape, dtype: str) -> str:
    """'' when the op runs this shape, else why not: fp8 needs K and N multiples of 16 (torch._scaled_mm's rule)."""
    if op_for(dtype) == "scaled_mm" and (shape.k % SCALED_MULTIPLE or shape.n % SCALED_MULTIPLE):
        return f"{shape.label()}: fp8 needs K and N multiples of {SCALED_MULTIPLE} (torch._scaled_mm's rule)"
    return ""


def _operand(rows: int, cols: int, transposed: bool, dtype: str, device: str) -> torch.Tensor:
    """rows x cols of a GemmProblem dtype; column-major storage when `transposed` (the 't' of a layout)."""
    shape = (cols, rows) if transposed else (rows, cols)
    if dtype == "int8":
        t = torch.randint(-128, 128, shape, dtype=torch.int8, device=device)
    else:
        t = torch.randn(shape, device=device, dtype=torch.float32).to(DTYPES_BY_NAME[dtype])
    return t.t() if transposed else t


def problem_for(shape: Shape, dtype: str, layout: str, device: str, scaling: str = "tensor") -> GemmProblem:
    """The GemmProblem of real tensors with this layout ('n': row-major, 't': column-major; A then B). fp8 is
    scaled_mm with `scaling` scales ("tensor" or "row") and a bf16 output; other dtypes ignore `scaling`."""
    why = layout_error(dtype, layout) or shape_error(shape, dtype)
    if why:
        raise ValueError(why)
    op, name = op_for(dtype), operand_dtype(dtype)
    a = _operand(shape.m, shape.k, layout[0] == "t", name, device)
    b = _operand(shape.k, shape.n, layout[1] == "t", name, device)
    if op != "scaled_mm":
        return GemmProblem.from_tensors(op, a, b)
    if scaling not in SCALINGS:
        raise ValueError(f"scaling must be one of {SCALINGS}, got {scaling!r}")
    return GemmProblem.from_tensors(op, a, b, scaling=scaling, out_dtype=SCALED_OUT_DTYPE)


@dataclass(frozen=True)
class UserCalls:
    """What a user calls for a problem, each taking the operands verify.make_inputs returns (a, b, then scaled_mm's
    scales): kernels' entry point, torch's own function (every ratio's baseline) and kernels.explain."""
    kernels: Callable
    torch: Callable
    explain: Callable


def user_calls(problem: GemmProblem) -> UserCalls:
    if problem.op == "scaled_mm":
        # bench problems carry no bias; out_dtype is bound once, so the timed call adds no Python frame of ours
        out_dtype = DTYPES_BY_NAME[problem.out_dtype]
        return UserCalls(functools.partial(kernels.scaled_mm, out_dtype=out_dtype),
                         functools.partial(torch._scaled_mm, out_dtype=out_dtype),
                         lambda a, b, scale_a, scale_b: kernels.explain(a, b, op="scaled_mm", scale_a=scale_a,
                                                                        scale_b=scale_b, out_dtype=out_dtype))
    if problem.op == "int_mm":
        return UserCalls(kernels.int_mm, torch._int_mm, lambda a, b: kernels.explain(a, b, op="int_mm"))
    return UserCalls(kernels.mm, torch.mm, lambda a, b: kernels.explain(a, b, op="mm"))


@dataclass
class TuneOutcome:
    """tune() for one backend set: the Selection (None when every candidate failed), failures, notes, wall time."""
    backends: tuple[str, ...]
    selection: Selection | None
    timings: dict
    choices: dict
    notes: list[str]
    seconds: float


def tune_backends(problem: GemmProblem, backends: tuple[str, ...]) -> TuneOutcome:
    start = time.perf_counter()
    try:
        sel, _ = tune(problem, backends, verify_all=True)
    except NoCandidateError as e:
        notes = [why for name, why in e.failures.items() if name == "-"]
        timings = {n: w for n, w in e.failures.items() if n != "-"}
        return TuneOutcome(backends, None, timings, {}, notes, time.perf_counter() - start)
    return TuneOutcome(backends, sel, sel.timings, sel.choices, list(sel.notes), time.perf_counter() - start)


def _unavailable_note(notes: list[str], backend: str) -> str | None:
    for note in notes:
        for part in note.split("; "):
            if part.startswith(f"{backend} unavailable: "):
                return part[len(f"{backend} unavailable: "):]      # the cell's status already says unavailable
            if part.startswith(f"{backend} failed:"):
                return part
    return None


def _aten_ms(outcome: TuneOutcome) -> float | None:
    """aten's time in the tune: its one candidate (aten_mm, aten_int_mm, aten_scaled_mm) when it was timed."""
    return next((t for name, t in outcome.timings.items() if name.startswith("aten_") and isinstance(t, float)),
                None)


def tuned_cell(column: Column, outcome: TuneOutcome, problem: GemmProblem, facts: DeviceFacts,
               flt: NameFilter, interpreted: bool) -> Cell:
    """The column's best candidate from its backend's tune, with its tune's times and speedup against aten in that
    tune (`tune_timing`; also the cell's numbers until bench.row measures the row together)."""
    pick = pick_best(outcome.timings, outcome.choices, column, flt)
    cell = Cell(column.name, "ok", tune_s=outcome.seconds, candidates=pick.candidates, failed=pick.failed,
                unsupported=pick.unsupported)
    if pick.name is None:
        why = _unavailable_note(outcome.notes, column.backend)
        if pick.candidates == 0 or pick.unsupported == pick.candidates:
            # no candidate, or none the template offers for this problem (split-K where the tiles fill the GPU):
            # nothing was built to fail
            cell.status = "unavailable"
            cell.message = why or f"{pick.failure} for {column.name} on this problem"
        else:
            # the built candidates' failures when there are any: beside "verified / built" the counts then agree
            cell.status, cell.message = "failed", pick.broken or pick.failure or "no result"
        return cell
    details = outcome.selection.details.get(pick.name, {}) if outcome.selection else {}
    cell.best, cell.median_ms, cell.measured = pick.name, pick.median_ms, "tune"
    cell.p20_ms, cell.p80_ms = spread_of(details, pick.median_ms)
    if interpreted:
        cell.message = pick.broken or ""       # correctness only: the candidates that failed are the news
        cell.tune_timing = TuneTiming(cell.median_ms, cell.p20_ms, cell.p80_ms)
        return cell
    cell.aten_ms = _aten_ms(outcome)
    fill_rates(cell, problem, facts)
    cell.tune_timing = TuneTiming(cell.median_ms, cell.p20_ms, cell.p80_ms, cell.aten_ms)
    return cell


def candidate_call(choice, problem: GemmProblem, sets) -> Call:
    """The user's call of a tuned candidate on the rotated sets, as its tune timed it: the backend builds it again,
    which loads what the tune built (the tune keeps only its winner's runner). The tune verified this binary; a
    CUTLASS one was verified in its child and then re-timed in this process by the tune's final round."""
    outcome = get_backend(choice.backend).build(problem, [choice])[0]
    if outcome.runner is None:
        raise RuntimeError(f"rebuilding {choice.name} failed: {outcome.error or 'no runner'}")
    return user_call(outcome.runner.launch, sets)


def spread_of(details: dict, median_ms: float) -> tuple[float | None, float | None]:
    """The 20th and 80th percentiles of the samples `median_ms` is the median of, or (None, None) when those are not
    on record. A finalist's time in a Selection is its final round's median, while its details keep the first pass's
    percentiles: printed beside each other they disagreed (a median outside its own p20-p80)."""
    if details.get("median_ms") != median_ms:
        return None, None
    return details.get("p20_ms"), details.get("p80_ms")


def fill_rates(cell: Cell, problem: GemmProblem, facts: DeviceFacts) -> None:
    cell.tflops, cell.pct_floor = rates(problem.flops, facts.floor_ms(problem.flops, problem.min_bytes),
                                        cell.median_ms)
    if cell.aten_ms:
        cell.speedup = cell.aten_ms / cell.median_ms


def rotated_sets(problem: GemmProblem, device: str) -> list[tuple[torch.Tensor, ...]]:
    """The same rotation tuning uses: enough input sets that consecutive calls do not find their inputs in L2."""
    return fresh_timing_sets(problem, device, 0)


def _calls(fn, sets) -> Call:
    return lambda i: fn(*sets[i])


def inductor_cell(problem: GemmProblem, sets) -> tuple[Cell, Call | None]:
    """torch.compile of torch's own function (torch.mm, torch._int_mm, torch._scaled_mm),
    mode="max-autotune-no-cudagraphs" (a CUDA graph would copy each rotated input set into its own buffers): its
    compile time and result checked; returns the cell and the compiled call, which bench.row times with the rest of
    the row (None when there is nothing to time)."""
    cell = Cell("inductor", "ok", best="torch.compile max-autotune-no-cudagraphs")
    if problem.device != "cuda":
        return Cell("inductor", "unavailable", message="needs a CUDA GPU (Inductor max-autotune)"), None
    import torch._dynamo   # noqa: PLC0415 - only the Inductor column needs dynamo
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no dynamic-shape fallback
    fn = torch.compile(user_calls(problem).torch, mode="max-autotune-no-cudagraphs", dynamic=False)
    start = time.perf_counter()
    try:
        out = fn(*sets[0])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - a compile failure is the cell's content
        return Cell("inductor", "failed", tune_s=time.perf_counter() - start,
                    message=f"compile failed: {type(e).__name__}: {str(e)[:200]}"), None
    cell.tune_s = time.perf_counter() - start
    result = check(problem, out, reference(problem, *sets[0]))
    if not result.ok:
        return Cell("inductor", "failed", tune_s=cell.tune_s, message=f"wrong result: {result.message}"), None
    return cell, _calls(fn, sets)


# how long the calls after a first call may take to finish its duel on calls before a benchmark times anyway
DUEL_LIMIT_S = 60.0


@dataclass
class DuelsRun:
    """What finishing the pending duels on calls took (`finish_duels`): wall seconds and calls, the last output,
    and whether the limit ended it with a duel still pending."""
    seconds: float | None = None
    calls: int = 0
    last: object = None
    timed_out: bool = False


def _any_duel_pending() -> bool:
    return kernels.stats()["duels_pending"] > 0


def finish_duels(call: Callable[[], object], device: str, every: int = 1, limit_s: float = DUEL_LIMIT_S,
                 pending: Callable[[], bool] = _any_duel_pending) -> DuelsRun:
    """Call `call` back to back, `every` calls between checks, while `pending()` (default: any duel on calls pending
    in this process; a problem's own: its selection's `duel`) -- KERNELS_DUEL=calls: a new large problem's tune ends
    after its first pass, and its duel with aten runs on the next 2-3 s of its calls -- so that a benchmark times the
    winners, not the duels. The seconds and calls are the tune's remaining cost, paid in calls that do the caller's
    work; None seconds: nothing was pending."""
    run = DuelsRun()
    if not pending():
        return run
    start = time.perf_counter()
    while pending():
        if time.perf_counter() - start >= limit_s:
            run.timed_out = True
            break
        for _ in range(every):
            run.last = call()
        run.calls += every
    if device == "cuda":
        torch.cuda.synchronize()
    run.seconds = time.perf_counter() - start
    return run


def seed_selection(outcome: TuneOutcome) -> None:
    """Publish a fresh tune where kernels.mm (same backends) looks first, so it serves exactly this selection."""
    if outcome.selection is None:
        return
    SelectionStore().put(store_key(outcome.selection.problem, fingerprint(outcome.backends)), outcome.selection)


def kernels_mm_result(problem: GemmProblem, backends: tuple[str, ...], sets) -> tuple[KernelsMmResult, Call | None]:
    """kernels.mm (int_mm, scaled_mm) as users call it: the first call (tunes or loads), checked against the
    reference. Returns the result and the call that bench.row times with the rest of the row (None after an error)."""
    config.backends = backends
    calls = user_calls(problem)
    first_set = sets[0]
    device = problem.device
    before = kernels.stats()
    start = time.perf_counter()
    try:
        out = calls.kernels(*first_set)
        if device == "cuda":
            torch.cuda.synchronize()
        first = time.perf_counter() - start
        finish_duels(lambda: calls.kernels(*first_set), device, every=20,   # the row times the winner
                     pending=lambda: calls.explain(*first_set).awaiting_calls)
        sel = calls.explain(*first_set)
    except Exception as e:  # noqa: BLE001 - e.g. NoCandidateError: the row says why
        return KernelsMmResult("error", first_call_s=time.perf_counter() - start,
                               message=f"{type(e).__name__}: {str(e)[:300]}"), None
    result = check(problem, out, reference(problem, *first_set))
    if not result.ok:
        return KernelsMmResult("error", winner=sel.winner, message=f"wrong result: {result.message}"), None
    regret = sel.regret() if device == "cuda" else None
    why_not_torch = _aten_cannot_run(problem) if device == "cuda" else ""
    return KernelsMmResult("ok", winner=sel.winner, source=first_call_source(before, kernels.stats()), regret=regret,
                           first_call_s=first, message=f"no torch baseline: {why_not_torch}" if why_not_torch else ""
                           ), _calls(calls.kernels, sets)


def _aten_cannot_run(problem: GemmProblem) -> str:
    """'' when torch's own function runs the problem (torch._int_mm refuses M <= 16 on CUDA), else why not."""
    return int_mm_limits(problem) if problem.op == "int_mm" else ""


def first_call_source(before: dict, after: dict) -> str:
    """Where the first call's selection came from, from the process counters around it (explain() afterwards
    reports 'memory' whatever the first call did)."""
    if after.get("tunes", 0) > before.get("tunes", 0):
        return "tuned"
    if after.get("disk_hits", 0) > before.get("disk_hits", 0):
        return "disk"
    if after.get("cpu_fallbacks", 0) > before.get("cpu_fallbacks", 0):
        return "cpu-fallback"
    return "memory"


def cutlass_compile_cell(column: Column, problem: GemmProblem, arch: int = 90) -> Cell:
    """No GPU: build the best-ranked CUTLASS candidate of the column for the problem as an sm90 device would run
    it (compile-only: nvcc and the CUTLASS headers are checked, nothing runs)."""
    backend = get_backend("cutlass")
    target = dataclasses.replace(problem, device="cuda", arch=arch, device_name=f"sm{arch} (compile-only)")
    ok, why = backend.available(target)
    if not ok:
        return Cell(column.name, "unavailable", message=why)
    try:
        choices = [c for c in backend.choices(target)[0] if column.owns(c)]
    except Exception as e:  # noqa: BLE001 - as a tune records a backend that fails: the cell says why
        return Cell(column.name, "unavailable", message=f"cutlass failed: {type(e).__name__}: {str(e)[:200]}")
    if not choices:
        return Cell(column.name, "unavailable", message=f"no CUTLASS config for {problem.short()}")
    start = time.perf_counter()
    outcome = backend.compile_only(target, choices[:1])[0]
    seconds = time.perf_counter() - start
    if outcome.error:
        return Cell(column.name, "failed", best=outcome.choice.name, tune_s=seconds, message=outcome.error[:300])
    return Cell(column.name, "compiled", best=outcome.choice.name, tune_s=seconds,
                message=f"compile-only (no GPU): {outcome.choice.name} built for sm{arch}a"
                        f"{'' if outcome.compiled else ' (already in the artifact store)'}")
