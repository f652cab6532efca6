"""choose(): support filter -> narrow (lookup table, name filters, benchmark space: kernels.candidates) -> build (in
parallel, per backend) -> benchmark -> verify the candidates that may still win -> re-time the best -> Selection.

Knows nothing about toolchains: backends hand back Runners; a failure anywhere is recorded, never raised.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import sys
import time
import warnings
from dataclasses import replace
from importlib import metadata
from typing import TYPE_CHECKING, Callable

import torch

from backends import child_handle, get_backend
from backends.child_handle import NOT_MEASURED
from backends.isolated_child import Unverified
from kernels.core import counters
from kernels.core.choice import NAME_FILTERED
from kernels.core.config import config
from kernels.core.errors import NoCandidateError
from kernels.core.problem import GemmProblem
from kernels.core.progress import status
from kernels.core.selection import UNMEASURED, Selection
from kernels.core.version import __version__
from kernels.measure.timing import user_call
from kernels.measure.verify import checked_inputs, fresh_timing_sets, verify_launch
from kernels.space.families import template_tree_hash
from kernels.tune.build_queue import request as request_build
from kernels.tune.candidates import Narrowed, fingerprint_extra, narrow
from kernels.tune.final_round import StageClock, contenders_of, not_verified, select

if TYPE_CHECKING:
    from backends.base import Backend, Runner


@functools.lru_cache(maxsize=None)
def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def fingerprint(backends: tuple[str, ...]) -> dict:
    """What a stored selection depends on besides the problem: versions, templates, the backend set."""
    return {"kernels": __version__, "torch": torch.__version__, "cuda": torch.version.cuda or "",
            "triton": _package_version("triton"), "templates": _template_hash(), "backends": list(backends), "space": config.search_space,
            **fingerprint_extra()}


@functools.lru_cache(maxsize=1)
def _template_hash() -> str:
    return template_tree_hash()


def _device_of(problem: GemmProblem) -> str:
    return "cuda" if problem.device == "cuda" else "cpu"


def candidates(backend: Backend, problem: GemmProblem) -> Narrowed:
    """What tune() builds for this backend (`kept`): its supported choices narrowed by the lookup table, the name
    filters and the benchmark space (kernels.tune.candidates); `skipped`: name -> why left out (unsupported ones
    too), and the narrowing's notes."""
    cands, skipped = backend.choices(problem, config.search_space)
    narrowed = narrow(problem, backend.name, cands)
    narrowed.filtered += sum(why == NAME_FILTERED for why in skipped.values())    # a backend's own filtering
    skipped.update(narrowed.skipped)
    narrowed.skipped = skipped
    return narrowed


@contextlib.contextmanager
def _cyclic_gc_paused():
    """Tuning makes tens of thousands of short-lived objects (a new shape ranks ~2,700 candidates), each burst a
    chance for a full collection whose cost grows with the caller's heap: 0.1-0.15 s per tune with three million
    objects alive, the time a new shape's whole candidate ranking takes. Reference counting frees what tuning makes;
    cycles wait for the collector to come back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def tune(problem: GemmProblem, backends: tuple[str, ...], *, verify_all: bool = False, defer_duel: bool = False
         ) -> tuple[Selection, dict[str, Runner]]:
    """Tune one problem; returns the Selection and the runners that passed verification (for dispatch), with those
    of `Selection.unmeasured` (not verified: for the isolated child's measurement on the calls only). A bad
    setting raises kernels.core.errors.SettingError before anything is built. Only the candidates a Selection's
    readers may run are verified (kernels.tune.final_round.OnDemandCheck); `verify_all` verifies every timed one
    (bench.compare's columns, the perf model's dataset, experiments that re-run candidates). `defer_duel`: a
    steady-regime duel is left to the caller's calls (Selection.duel names its challenger, whose runner is returned
    beside the winner's; kernels.dispatch.call_duel)."""
    config.validate()
    with _cyclic_gc_paused(), status(f"kernels: tuning {problem.short()}") as update:
        return _tune(problem, backends, lambda stage: update(f"kernels: tuning {problem.short()}: {stage}"),
                     verify_all=verify_all, defer_duel=defer_duel)


def _tune(problem: GemmProblem, backends: tuple[str, ...], on_stage: Callable[[str], None] | None = None, *,
          verify_all: bool = False, defer_duel: bool = False) -> tuple[Selection, dict[str, Runner]]:
    start = time.perf_counter()
    clock = StageClock(on_stage)
    device = _device_of(problem)
    timings: dict[str, float | str] = {}
    choices = {}
    notes: list[str] = []
    runners: dict[str, Runner] = {}
    unavailable: list[str] = []
    pending: list[str] = []
    filtered_out = 0

    for name in _isolated_first(backends):
        try:
            backend = get_backend(name)
            ok, why = backend.available(problem)
            if ok and problem.epilogue and not backend.epilogues:
                ok, why = False, f"no fused {problem.epilogue} epilogue in this backend"
            if not ok:
                notes.append(f"{name} unavailable: {why}")
                unavailable.append(name)
                continue
            with clock("candidates"):
                narrowed = candidates(backend, problem)
            notes.extend(narrowed.notes)
            for cname, why in narrowed.skipped.items():
                timings[cname] = f"unsupported: {why}"
            cands = narrowed.kept
            for c in cands:
                choices[c.name] = c
            filtered_out += narrowed.filtered
            with clock("build"):
                outcomes = backend.build(problem, cands)
            waiting = [o.choice for o in outcomes if o.pending]
            if waiting:     # left to the background build: tuned without them, re-tuned once they are built
                pending += [c.name for c in waiting]
                notes += [n for n in (request_build(problem, waiting),) if n]
            for outcome in outcomes:
                if outcome.runner is None:
                    timings[outcome.choice.name] = outcome.error or "build failed"
                else:
                    runners[outcome.choice.name] = outcome.runner
            cache_faults = sum(o.environment for o in outcomes)
            if cache_faults:
                notes.append(f"{name}: {cache_faults} candidate(s) failed on the cache (an OS error, not the kernel); "
                             "tuned without them, and again at the next cold lookup")
                unavailable.append(name)
            if any(o.runner is not None and o.runner.isolated for o in outcomes):
                _prestart_child(device)
        except Exception as e:  # noqa: BLE001 - one broken backend must not take tuning down
            notes.append(f"{name} failed: {type(e).__name__}: {e}")
            if isinstance(e, OSError):      # the cache, not the backend: tune again at the next cold lookup
                unavailable.append(name)

    if config.only and filtered_out and not any(c.backend != "aten" for c in choices.values()):
        _warn_only_matched_nothing(unavailable)
    details: dict[str, dict] = {}
    isolated = {n: r for n, r in runners.items() if r.isolated}
    unmeasured: list[str] = []
    passed_isolated: dict[str, Runner] = {}
    verified: dict[str, Runner] = {}

    winner, regime, duel = None, "burst", None
    candidates_here = {n: r for n, r in runners.items() if not r.isolated}
    if candidates_here or isolated:
        seed = int(time.time_ns() % (1 << 30))
        with clock("verify"):
            operands, ref = checked_inputs(problem, device, seed)
        sets = fresh_timing_sets(problem, device, seed + 1)

        def verify(name: str) -> str | None:
            """Asked by the selection once `name` may become a finalist (kernels.tune.final_round.OnDemandCheck)."""
            why = verify_launch(candidates_here[name].launch, problem, operands, ref)
            if why is None:
                verified[name] = candidates_here[name]
            return why

        def measured_in_child(may_leave: bool) -> dict:
            """Isolated runners, verified and timed in the child (asked after this process's first pass: the child,
            started during the build, comes up meanwhile); those that pass are safe to re-time here. `may_leave`:
            the caller's calls finish this selection, so where the child is still starting (a process's first tune:
            seconds of Python and torch) they are left to those calls (Selection.unmeasured) rather than waited for."""
            state = child_state(_device_index(device)) if may_leave else "up"
            if state == "starting":
                unmeasured.extend(isolated)
                timings.update({n: f"{UNMEASURED}: the isolated child was starting" for n in isolated})
                return {}
            if state != "up":       # no child to be had: their failure, as when it dies while measuring
                timings.update({n: f"{NOT_MEASURED}: {state}" for n in isolated})
                return {}
            with clock("isolated"):
                passed_isolated.update(measure_isolated(problem, isolated, timings, details, verify_all))
            return {n: (timings[n], user_call(r.launch, sets)) for n, r in passed_isolated.items()}
        outcome = select({n: user_call(r.launch, sets) for n, r in candidates_here.items()}, choices, len(sets),
                         device, config.bench_budget_ms, isolated=measured_in_child if isolated else None,
                         timings=timings, details=details, clock=clock, verify=verify, verify_all=verify_all,
                         defer_duel=defer_duel)
        verified.update(passed_isolated)
        winner, regime, duel = outcome.winner, outcome.regime, outcome.duel
        notes.extend(outcome.notes)
        del sets, ref, operands
    if winner is None:
        failures = {n: str(t) for n, t in timings.items()}
        failures.update({f"note {i}": n for i, n in enumerate(notes)})
        raise NoCandidateError(problem.short(), failures)

    sel = Selection(problem=problem, winner=winner, choices=choices, timings=timings, details=details,
                    source="tuned", tune_seconds=time.perf_counter() - start, created=time.time(), notes=notes,
                    stage_seconds={k: round(v, 4) for k, v in clock.seconds.items()}, unavailable=unavailable,
                    regime=regime, pending=pending, duel=duel, unmeasured=unmeasured)
    counters.bump("tunes")
    if config.verbose:
        print(sel.table(), file=sys.stderr)
    # the unmeasured runners are for the child's measurement only, never run here before it has verified them
    return sel, {**{n: verified[n] for n in (winner, duel) if n is not None}, **{n: isolated[n] for n in unmeasured}}


class NameFilterWarning(UserWarning):
    """KERNELS_ONLY left a tune nothing but aten to time."""


_warned_filters: set[tuple[str, ...]] = set()


def _warn_only_matched_nothing(unavailable: list[str]) -> None:
    """KERNELS_ONLY matching none of a problem's candidates is most likely a typo in a regex (KERNELS_SKIP leaving
    only aten may well be meant: no warning). The tune still runs, on aten alone. Once a process per filter."""
    if config.only in _warned_filters:
        return
    _warned_filters.add(config.only)
    missing = f"; unavailable here: {', '.join(unavailable)}" if unavailable else ""
    warnings.warn(f"kernels: KERNELS_ONLY={','.join(config.only)} matched none of a problem's candidates, so only aten "
                  f"was timed{missing}. The expressions are searched (re.search) in candidate names, as "
                  "kernels.explain() and `python -m kernels cache show` list them", NameFilterWarning, stacklevel=2)


def _isolated_first(backends: tuple[str, ...]) -> list[str]:
    """The backends in build order: those whose runners are measured in the child first, so the child starts
    (`_prestart_child`) while the others build, verify and time."""
    def isolated(name: str) -> bool:
        try:
            return bool(get_backend(name).isolated)
        except Exception:  # noqa: BLE001 - the build loop reports a broken backend
            return False
    return sorted(backends, key=lambda name: not isolated(name))


def _device_index(device: str) -> int | None:
    return torch.cuda.current_device() if device == "cuda" else None


def child_state(device_index: int | None) -> str:
    """"up", "starting" or "failed: why" (backends.child_handle.start_state: one is started when none runs). Never
    waits, never raises."""
    return child_handle.start_state(device_index)


def _prestart_child(device: str) -> None:
    """Start the isolated child now (a Python process, torch, a CUDA context: 5 s on the H100, sixteenth session;
    5.1-5.4 s on an H200 host whose `import torch` takes 3-4 s, thirty-fourth): paid once per process, it then
    overlaps the first tune's in-process build and first pass instead of following them."""
    try:
        child_handle.prestart(_device_index(device))
    except Exception:  # noqa: BLE001 - whoever asks the child next finds out why, and records it per candidate
        pass


def measure_isolated(problem, runners, timings, details, verify_all: bool = False) -> dict[str, Runner]:
    """Runners whose backend asks for isolation are timed and verified in a child process by that backend, whose
    cutoffs start from this process's fastest first pass (`timings` holds it by now). Only the verified may run
    here; the child leaves unverified those no final round could take (backends.isolated_child)."""
    by_backend: dict[str, list[Runner]] = {}
    for runner in runners.values():
        by_backend.setdefault(runner.choice.backend, []).append(runner)
    passed: dict[str, Runner] = {}
    first_pass = [t for t in timings.values() if isinstance(t, float)]      # this process's, measured just before
    best_ms = min(first_pass) if first_pass else None
    for name, group in by_backend.items():
        try:
            results = get_backend(name).measure_isolated(problem, group, config.bench_budget_ms, best_ms=best_ms,
                                                         verify_all=verify_all)
        except Exception as e:  # noqa: BLE001
            results = {r.choice.name: f"{NOT_MEASURED}: the isolated measurement failed: {type(e).__name__}: {e}"
                       for r in group}
        for runner in group:
            res = results.get(runner.choice.name, f"{NOT_MEASURED}: no result from the isolated child")
            if isinstance(res, str):
                timings[runner.choice.name] = res
                continue
            timing = res.timing if isinstance(res, Unverified) else res
            counters.bump("benchmarks")
            details[runner.choice.name] = {**timing.as_dict(), "measured_in": "child"}
            if isinstance(res, Unverified):     # the child verified faster ones: no final round can take it
                timings[runner.choice.name] = not_verified(timing.median_ms)
            else:
                timings[runner.choice.name] = timing.median_ms
                passed[runner.choice.name] = runner
    return passed


def join_unmeasured(problem: GemmProblem, sel: Selection, runners: dict[str, Runner], child: str = "up"
                    ) -> tuple[Selection, Runner | None] | None:
    """`sel` once its unmeasured candidates (Selection.unmeasured: left to the calls while the isolated child was
    starting) are measured in the child, which is up by now (`child`, child_state's word: where it "failed", none is
    asked), as the tune would have: their times or failures recorded, and the challenger chosen again among the
    verified (the pending one and those the child passed) by the tune's rule (kernels.tune.final_round.
    contenders_of). `runners` holds every unmeasured one (the dispatch moves those that do not load to `pending`
    before); those the child gives no result for (it failed) fail, as in a tune. The caller's queued work on its
    stream is waited for first, so the child times on an idle GPU. Returns the new selection (its `duel` the
    challenger; None: the winner is decided) and the challenger's runner where it is one of `runners`; None when the
    child, up when asked, has been ended since (another thread's fault): to be asked again."""
    start = time.perf_counter()
    timings, details = dict(sel.timings), {n: dict(d) for n, d in sel.details.items()}
    todo = {n: runners[n] for n in sel.unmeasured}
    if child != "up":
        timings.update({n: f"{NOT_MEASURED}: {child}" for n in todo})
        todo = {}
    with child_handle.lock:     # held through the measurement: no other thread ends the child in between
        if todo and not child_handle.serving():
            return None
        if problem.device == "cuda":
            torch.cuda.current_stream().synchronize()
        passed = measure_isolated(problem, todo, timings, details) if todo else {}
    found = contenders_of(sel.winner, timings, {*passed, *([sel.duel] if sel.duel else [])})
    challenger = found[0] if found else None
    unanswered = [n for n in sel.unmeasured if str(timings.get(n)).startswith(NOT_MEASURED)]
    note = (f"steady round: {len(sel.unmeasured) - len(unanswered)} candidate(s) measured in the isolated child on "
            "the caller's calls" + (f" ({len(unanswered)} not measured: the child failed)" if unanswered else "") + "; "
            + (f"{challenger} (first pass {timings[challenger] / timings[sel.winner]:.3f}x {sel.winner}'s) duels "
               f"{sel.winner} there" if challenger else
               f"none ran: no verified candidate came within reach of {sel.winner}'s first pass"))
    stages = {**sel.stage_seconds, "isolated_on_calls": round(time.perf_counter() - start, 4)}
    joined = replace(sel, timings=timings, details=details, unmeasured=[], duel=challenger, notes=[*sel.notes, note],
                     stage_seconds=stages, created=max(time.time(), sel.created + 1e-3), source="tuned")
    return joined, passed.get(challenger) if challenger is not None else None


def prebuild(problems: list[GemmProblem], backends: tuple[str, ...]) -> dict[str, int]:
    """Compile ahead what tune() will build for each of these problems (same choices, same narrowing), one batch
    per backend that batches (`Backend.prebuild`); tune() then loads those binaries. Returns backend -> compiled.
    Best effort: a backend that fails here fails again, with its reason, in tune()."""
    compiled = {}
    for name in backends:
        try:
            backend = get_backend(name)
            work = []
            for problem in problems:
                if backend.available(problem)[0]:
                    work.append((problem, candidates(backend, problem).kept))
            compiled[name] = backend.prebuild(work)
        except Exception:  # noqa: BLE001 - tune() reports the same failure per problem
            compiled[name] = 0
    return compiled
