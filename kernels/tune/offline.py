"""`python -m kernels tune`: tune a list of problems ahead of time, exactly as users' first calls would, and report
what came of each.

Problems the selection store has are skipped, so a run cut short (--time-limit, ^C) goes on where it stopped when it
is run again. The CUTLASS candidates of the rest are compiled first, in one batch of parallel compiles (as `kernels
warmup` does): a problem has a handful, so per-problem builds would leave most cores idle. Then each problem is
looked up through the api's cold path (memory -> store -> tune): what is stored is what a user's first call would
have tuned. The lookups live in kernels.dispatch (kernels.dispatch.record: `stored`, `replay`), above this layer, and
are handed in; this module holds the order of work, the time limit and the report.
"""
from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backends import get_backend
from kernels.core import progress
from kernels.core.config import config, interpret_mode
from kernels.core.problem import GemmProblem, gpu_of
from kernels.core.selection import Selection
from kernels.tune.autotune import candidates
from kernels.tune.problem_list import Listed, retarget

TUNED, IN_STORE, FAILED, LEFT = "tuned", "in store", "failed", "left"
DYNAMIC_LOOKUP = "dynamic: looked up, tuned where the store lacks its hints or bucket"
# the backend whose prebuild compiles many problems' binaries in one batch (Backend.prebuild); the others build per
# problem in tune() already using every core
BATCHED = "cutlass"


@dataclass
class Outcome:
    item: Listed
    status: str                          # TUNED | IN_STORE | FAILED | LEFT
    selection: Selection | None = None
    seconds: float = 0.0                 # wall time of this problem's lookup (tune, or load and verify)
    reason: str = ""                     # why it failed or was left


@dataclass
class Report:
    outcomes: list[Outcome]
    seconds: float = 0.0
    compiled: int = 0                    # CUTLASS binaries the batch compiled
    compile_seconds: float = 0.0
    stopped: str = ""                    # why problems were left: the time limit, an interrupt; "" when none were
    notes: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)


def target() -> tuple[str, int, str] | None:
    """(device, arch, device name) of what tunes here: the current GPU, or the CPU through the Triton interpreter
    (TRITON_INTERPRET=1); None without either."""
    if torch.cuda.is_available():
        return ("cuda", *gpu_of(torch.cuda.current_device()))
    if interpret_mode():
        return "cpu", 0, "cpu"
    return None


def split(items: list[Listed], stored: Callable[[GemmProblem], Selection | None]) -> tuple[list[Outcome],
                                                                                          list[Listed]]:
    """(outcomes of the problems the store has, the problems to tune). A dynamic problem is always looked up: its
    hints and buckets are the dispatcher's to check, and one that is all stored costs a load, no tune. A stored
    selection tuned while candidates were still being built is looked up too (its cold lookup may re-tune it)."""
    done, todo = [], []
    for item in items:
        sel = None if item.problem.dynamic else stored(item.problem)
        if sel is not None and not sel.pending:
            done.append(Outcome(item, IN_STORE, sel))
        else:
            todo.append(item)
    return done, todo


def prebuild(problems: list[GemmProblem], on_progress: Callable[[int, int], None] | None = None) -> int:
    """Compile the CUTLASS candidates tune() will build for these problems (same narrowing), in one batch of
    config.max_jobs parallel compiles; returns how many were compiled. Best effort: what fails here fails again,
    with its reason, in the problem's tune."""
    if BATCHED not in config.backends or not problems:
        return 0
    try:
        backend = get_backend(BATCHED)
        work = [(p, candidates(backend, p).kept) for p in problems if backend.available(p)[0]]
        return backend.prebuild(work, config.max_jobs, on_progress) if work else 0
    except Exception:  # noqa: BLE001 - each problem's tune reports the failure with its reason
        return 0


def run(items: list[Listed], stored: Callable[[GemmProblem], Selection | None], replay: Callable[[Listed], object],
        time_limit: float | None = None, log=None) -> Report:
    """Tune the listed problems (already on this device: problem_list.retarget) that the store lacks. `replay(item)`
    looks one up as a user's first call does and returns (its Selection, whether it tuned). No new problem starts once
    `time_limit` seconds have passed since the start; ^C stops the run, leaving the rest, and the report says so.
    Progress: a bar on a terminal, else one line per problem on `log` (stderr)."""
    log = log or sys.stderr

    def here(report: Report, todo: list[Listed], start: float) -> None:
        prebuild_listed(report, todo, log)
        _tune_each(report, todo, replay, start, time_limit, log)

    return run_with(items, stored, here, time_limit)


def run_with(items: list[Listed], stored: Callable[[GemmProblem], Selection | None],
             tune_todo: Callable[[Report, list[Listed], float], None], time_limit: float | None = None) -> Report:
    """The order of work every tune run shares: what the store has is reported, `tune_todo(report, todo, start)`
    tunes the rest (in this process, or spread over GPUs: kernels.tune.on_gpus) unless `time_limit` is 0, and the
    outcomes come back in the list's order."""
    start = time.perf_counter()
    done, todo = split(items, stored)
    report = Report(done)
    if todo and time_limit is not None and time_limit <= 0:
        report.stopped = leave(report, todo, f"--time-limit {time_limit:g} s reached")
        todo = []
    if todo:
        tune_todo(report, todo, start)
    order = {item.same(): i for i, item in enumerate(items)}
    report.outcomes.sort(key=lambda o: order[o.item.same()])
    report.seconds = time.perf_counter() - start
    return report


def _tune_each(report: Report, todo: list[Listed], replay, start: float, time_limit: float | None, log) -> None:
    with progress.held_by_caller(), progress.bar(len(todo), "problems tuned") as advance:
        for index, item in enumerate(todo):
            if time_limit is not None and time.perf_counter() - start >= time_limit:
                report.stopped = leave(report, todo[index:], f"--time-limit {time_limit:g} s reached")
                return
            try:
                outcome = tune_one(item, replay)
            except KeyboardInterrupt:
                report.stopped = leave(report, todo[index:], "interrupted")
                return
            report.outcomes.append(outcome)
            advance(index + 1)
            if not progress.shown():
                print(f"[{index + 1}/{len(todo)}] {line(outcome)}", file=log, flush=True)


def tune_one(item: Listed, replay) -> Outcome:
    """One problem looked up through `replay`: TUNED or IN_STORE with its Selection, or FAILED with the reason."""
    start = time.perf_counter()
    try:
        sel, tuned = replay(item)
    except Exception as e:  # noqa: BLE001 - one problem that cannot be tuned does not end the run
        return Outcome(item, FAILED, seconds=time.perf_counter() - start, reason=f"{type(e).__name__}: {e}")
    return Outcome(item, TUNED if tuned else IN_STORE, sel, time.perf_counter() - start)


def leave(report: Report, rest: list[Listed], why: str) -> str:
    report.outcomes.extend(Outcome(item, LEFT, reason=why) for item in rest)
    return why


def prebuild_listed(report: Report, todo: list[Listed], log) -> None:
    static = [item.problem for item in todo if not item.problem.dynamic]
    if BATCHED not in config.backends or not static:
        return
    start = time.perf_counter()
    what = f"compiling the CUTLASS candidates of {len(static)} problems ({config.max_jobs} parallel compiles)"
    if not progress.shown():
        print(f"{what} ...", file=log, flush=True)
    with progress.status(what) as update:
        report.compiled = prebuild(static, lambda done, total: update(f"{what}: {done}/{total}"))
    report.compile_seconds = time.perf_counter() - start
    report.notes.append(f"compiled {report.compiled} CUTLASS kernels in {report.compile_seconds:.1f} s first")


# -- the report ----------------------------------------------------------------------------------------------------
def label(problem: GemmProblem) -> str:
    """'mm 64x48x32 fp16 nt bias+gelu', 'scaled_mm 16x4096x4096 e4m3 nt row->bf16': n/t per operand as
    bench.compare's --layout (s: strided)."""
    layout = "".join({"row": "n", "col": "t"}.get(lay, "s") for lay in (problem.layout_a, problem.layout_b))
    dtype = f"{problem.dtype}/{problem.precision}" if problem.precision else problem.dtype
    scaled = f"{problem.scaling}->{problem.out_dtype}" if problem.scaling else ""
    parts = [problem.op, f"{problem.m}x{problem.n}x{problem.k}", dtype, layout, scaled, problem.epilogue,
             f"dynamic {','.join(problem.dynamic)}" if problem.dynamic else ""]
    return " ".join(p for p in parts if p)


def speedup(sel: Selection | None) -> float | None:
    """aten's time over the winner's, from the Selection's timings; None when either was not timed."""
    if sel is None:
        return None
    aten = next((t for n, t in sel.timings.items() if isinstance(t, float) and n in sel.choices and
                 sel.choices[n].backend == "aten"), None)
    best = sel.timings.get(sel.winner)
    return aten / best if isinstance(aten, float) and isinstance(best, float) and best > 0 else None


def _source(o: Outcome) -> str:
    return f"{o.status}: {o.reason}" if o.reason else o.status


def line(o: Outcome) -> str:
    """One problem's outcome on one line (the progress log)."""
    if o.selection is None:
        return f"{label(o.item.problem)}: {_source(o)}"
    ratio = speedup(o.selection)
    vs = f", {ratio:.2f}x aten" if ratio else ""
    return f"{label(o.item.problem)}: {o.status} in {o.seconds:.1f} s -> {o.selection.winner}{vs}"


def summary(report: Report) -> str:
    """The table (problem, winner, speedup over aten, tune seconds, source) and the totals."""
    rows = [("problem", "winner", "vs aten", "tune s", "source")]
    for o in report.outcomes:
        ratio = speedup(o.selection)
        rows.append((label(o.item.problem), o.selection.winner if o.selection else "-",
                     f"{ratio:.2f}x" if ratio else "-", f"{o.seconds:.1f}" if o.status == TUNED else "-",
                     _source(o)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    counts = Counter(o.status for o in report.outcomes)
    totals = ", ".join(f"{counts[s]} {s}" for s in (TUNED, IN_STORE, FAILED, LEFT))
    lines.append(f"{len(report.outcomes)} problems: {totals}; {report.seconds:.1f} s")
    lines.extend(report.notes)
    if report.stopped:
        lines.append(f"{counts[LEFT]} left ({report.stopped}): run the same command again to go on; problems in the "
                     "store are skipped")
    return "\n".join(lines)


def dry_run(items: list[Listed], where: tuple[str, int, str] | None,
            stored: Callable[[GemmProblem], Selection | None]) -> str:
    """What a run would do: each problem, where it was listed, and whether it would be tuned."""
    if where is None:
        rows = [(label(i.problem), i.where, "would be tuned (no GPU here: the store was not checked)") for i in items]
    else:
        items = retarget(items, *where)
        kept = {o.item.same() for o in split(items, stored)[0]}
        rows = [(label(i.problem), i.where, IN_STORE if i.same() in kept else
                 DYNAMIC_LOOKUP if i.problem.dynamic else "would be tuned") for i in items]
    width = [max(len(r[c]) for r in rows) for c in range(2)]
    lines = [f"{r[0].ljust(width[0])}  {r[1].ljust(width[1])}  {r[2]}" for r in rows]
    counts = Counter(r[2] for r in rows)
    dynamic = f", {counts[DYNAMIC_LOOKUP]} dynamic" if counts[DYNAMIC_LOOKUP] else ""
    lines.append(f"{len(rows)} problems: {len(rows) - counts[IN_STORE] - counts[DYNAMIC_LOOKUP]} would be tuned, "
                 f"{counts[IN_STORE]} in store{dynamic} (dry run: nothing tuned)")
    return "\n".join(lines)
