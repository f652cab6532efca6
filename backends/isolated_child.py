"""Verify and time candidates of any backend in a child process (`python -m backends.isolated_child`).

A kernel that faults (illegal address) poisons its CUDA context for good, so it must not run in the caller.
Backends whose `isolated` attribute is set (CUTLASS's) measure their runners here.
The parent keeps one child per process (backends.child_handle) and sends it one JSON request per line on stdin; the
child answers one tagged JSON line per event on stdout: {"start": name} before touching a candidate (to time it, and
again to verify it), {"timed": name} when its timing ended well, then {"name", "timing"} (verified),
{"name", "timing", "unverified": true} or {"name", "error"}, and a tagged `done` line after the request. When the
child dies or times out, the candidate that started without an answer is the culprit; the rest run in a fresh child.

Every candidate is timed first; then, fastest first, verified: all of them, except where the calls are GPU-bound
(the caller's fastest first pass and the child's STEADY_MIN_MS or more) and the request does not ask for all
(`verify_all`): the caller's final round then duels one challenger, so the child verifies until VERIFIED_TOP pass and
reports the rest unverified (they cannot be finalists).
The checks and timing are kernels.verify and kernels.timing, exactly as in-process tuning uses them.

`FAULT_INJECTION = <choice name>` (set in the parent, passed in the request) makes the child kill itself (SIGSEGV)
when it starts that candidate, so the isolation itself can be tested on any machine.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

from backends import child_handle, get_backend
from backends.child_handle import DONE, NOT_MEASURED, TAG
from kernels.core.cache_root import cache_root
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.problem import GemmProblem
from kernels.measure.steady import STEADY_MIN_MS
from kernels.measure.timing import (GPU_BOUND_SAMPLES, QUICK_SCREEN, TUNE_CUTOFF, Timing, gpu_bound, measure,
                                    user_call)
from kernels.measure.verify import VERIFIED_TOP, checked_inputs, fresh_timing_sets, verify_launch
from kernels.native import fastpath

# Tests only: the choice name at which the child kills itself (None: no fault)
FAULT_INJECTION: str | None = None


def _emit(obj: dict) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


@dataclass(frozen=True)
class Unverified:
    """A candidate the child timed and did not verify (it could not be a finalist): it must not run in the caller."""
    timing: Timing


# -- parent side ----------------------------------------------------------------------------------------------------
def _parse(stdout: str) -> tuple[dict[str, dict], str | None]:
    """Answers by name, and the candidate that started without an answer (None if every start was answered)."""
    answers: dict[str, dict] = {}
    in_flight = None
    for line in stdout.splitlines():
        if not line.startswith(TAG):
            continue
        try:
            msg = json.loads(line[len(TAG):])
        except ValueError:
            continue
        if "start" in msg:
            in_flight = msg["start"]
        elif "timed" in msg:
            if in_flight == msg["timed"]:
                in_flight = None
        elif "name" in msg:
            answers[msg["name"]] = msg
            if in_flight == msg["name"]:
                in_flight = None
    return answers, in_flight


def run_isolated(backend: str, problem, choices, budget_ms: float, timeout_s: float,
                 best_ms: float | None = None, verify_all: bool = False) -> dict:
    """name -> kernels.timing.Timing (verified), Unverified, or failure text, for every choice of `backend`;
    `best_ms` (the caller's fastest first-pass median, if any) seeds the child's cutoffs, so one first pass spans
    both processes, and tells the child whether the caller will duel (then it verifies its fastest VERIFIED_TOP
    only, unless `verify_all`). Never raises for a kernel's fault."""
    results: dict = {}
    remaining = list(choices)
    seed = int(time.time_ns() % (1 << 31))
    with child_handle.lock:
        child_handle.warmed(timeout_s)
        while remaining:
            request = {"backend": backend, "problem": json.loads(problem.key()),
                       "choices": [c.as_dict() for c in remaining], "budget_ms": budget_ms, "seed": seed,
                       "device": torch.cuda.current_device() if torch.cuda.is_available() else 0,
                       "cache_dir": str(cache_root()), "fault": FAULT_INJECTION, "best_ms": best_ms,
                       "verify_all": verify_all}
            stdout, ended = child_handle.started().ask(request, timeout_s)
            why = ""
            if ended != "done":
                status, stderr = child_handle.discard(kill=True)
                why = (f"timed out after {timeout_s:.0f} s in the isolated child" if ended == "timed out" else
                       f"isolated child exited with status {status}: {stderr.strip()}")
            answers, in_flight = _parse(stdout)
            for name, msg in answers.items():
                if "timing" not in msg:
                    results[name] = str(msg.get("error", "no error text"))
                else:
                    timing = Timing(**msg["timing"])
                    results[name] = Unverified(timing) if msg.get("unverified") else timing
            if in_flight is not None and in_flight not in results:
                results[in_flight] = f"crashed: {why or 'no answer from the isolated child'}"
            left = [c for c in remaining if c.name not in results]
            if len(left) == len(remaining):   # no progress at all: the child cannot start; do not loop
                for c in left:
                    results[c.name] = f"{NOT_MEASURED}: {why or 'no answer from the isolated child'}"
                break
            remaining = left
    return results


# -- child side -----------------------------------------------------------------------------------------------------
def context_alive(device: str) -> bool:
    """Whether this process's CUDA context still runs work (a faulting kernel leaves a sticky error); True off CUDA."""
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        (torch.ones(1, device="cuda") + 1).item()
        return True
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


def main() -> int:
    """Serve requests, one JSON line each, until the end of input; 3 when a fault has poisoned the CUDA context
    (the parent starts a fresh child for the rest)."""
    for line in sys.stdin:
        if not line.strip():
            continue
        status = serve(json.loads(line))
        if status:
            return status
        if torch.cuda.is_available():
            torch.cuda.empty_cache()     # between requests the child holds its CUDA context, not the inputs' memory
        sys.stdout.write(TAG + DONE + "\n")
        sys.stdout.flush()
    return 0


def serve(request: dict) -> int:
    """One request: time each choice, then verify those the caller may use (module docstring), one tagged answer per
    event; non-zero when the context is gone."""
    if request.get("warmup"):
        _warm_up(request)
        return 0
    config.cache_dir = request["cache_dir"]
    problem = GemmProblem.from_dict(request["problem"])
    device = problem.device
    if device == "cuda":
        torch.cuda.set_device(request["device"])
    choices = [Choice.from_dict(c) for c in request["choices"]]
    budget_ms = float(request["budget_ms"])
    if device == "cuda":
        fastpath.load_if_built()            # so native launches are verified and timed here like the caller's
    outcomes = get_backend(request["backend"]).build(problem, choices)    # artifacts exist: this only loads
    fault = request.get("fault")

    operands, ref = checked_inputs(problem, device, request["seed"])
    sets = fresh_timing_sets(problem, device, request["seed"] + 1)
    n_sets = len(sets)

    # the fastest median so far (the caller's first pass's to start with): the cutoffs, one candidate at a time
    best_ms = _positive_or_none(request.get("best_ms"))
    callers_best = best_ms
    timed: dict[str, Timing] = {}
    launches = {}
    verdicts: dict[str, str | None] = {}

    def verify(name: str) -> str | None:
        """None when `name` computes the right result, else why not; once per candidate."""
        if name not in verdicts:
            try:
                verdicts[name] = verify_launch(launches[name], problem, operands, ref)
            except Exception as e:  # noqa: BLE001 - one candidate's failure is data
                verdicts[name] = f"crashed: {type(e).__name__}: {str(e)[:300]}"
        return verdicts[name]

    for outcome in outcomes:
        name = outcome.choice.name
        _emit({"start": name})
        if name == fault:
            os.kill(os.getpid(), signal.SIGSEGV)
        if outcome.runner is None:
            _emit({"name": name, "error": outcome.error or "build failed"})
            continue
        launches[name] = outcome.runner.launch
        try:
            timing = measure(user_call(launches[name], sets), n_sets, device, budget_ms, **_cutoffs(best_ms, device))
        except Exception as e:  # noqa: BLE001 - one candidate's failure is data
            _emit({"name": name, "error": f"crashed: {type(e).__name__}: {str(e)[:300]}"})
            if not context_alive(device):
                return 3      # the context is poisoned: the parent runs the rest in a fresh child
            continue
        if best_ms is None or timing.median_ms < best_ms:
            # it would set the cutoffs and screen of those after it: only once it computes the right result
            why = verify(name)
            if why is not None:
                _emit({"name": name, "error": why})
                if not context_alive(device):
                    return 3
                continue
            best_ms = timing.median_ms
        timed[name] = timing
        _emit({"timed": name})

    keep = None if request.get("verify_all") or not _duel_only(callers_best, timed, device) else VERIFIED_TOP
    return _verify_fastest_first(timed, verify, keep, lambda: context_alive(device))


def _verify_fastest_first(timed: dict[str, Timing], verify, keep: int | None, alive) -> int:
    """Verify the timed candidates fastest first and answer for each: its timing once it passes, its failure, or
    (once `keep` have passed; None: never) its timing marked unverified. 3 when a failure left the context dead.
    `verify(name)`: None or why not, never raising (serve's remembers what it checked while timing)."""
    found = 0
    for name in sorted(timed, key=lambda n: timed[n].median_ms):
        if keep is not None and found >= keep:
            _emit({"name": name, "timing": timed[name].as_dict(), "unverified": True})
            continue
        _emit({"start": name})
        why = verify(name)
        if why is not None:
            _emit({"name": name, "error": why})
            if not alive():
                return 3
            continue
        found += 1
        _emit({"name": name, "timing": timed[name].as_dict()})
    return 0


def _duel_only(callers_best: float | None, timed: dict[str, Timing], device: str) -> bool:
    """Whether the caller's final round will be the steady regime's duel (kernels.tune.final_round), which takes one
    challenger: the caller's fastest first pass and every timing here STEADY_MIN_MS or more, on a GPU."""
    return (device == "cuda" and callers_best is not None and callers_best >= STEADY_MIN_MS and bool(timed)
            and min(t.median_ms for t in timed.values()) >= STEADY_MIN_MS)


def _positive_or_none(value) -> float | None:
    """A request's number as sent by run_isolated: a positive finite float, or None for anything else."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


def _cutoffs(best_ms: float | None, device: str) -> dict:
    """The in-process first pass's cutoffs (kernels.measure.timing), against the fastest candidate timed so far;
    the screen, and the GPU-bound candidates' fewer samples, on the GPU only, as in-process."""
    if best_ms is None:
        return {}
    if device == "cuda" and gpu_bound(best_ms):
        return {"stop_above_ms": best_ms * TUNE_CUTOFF, "screen_above_ms": best_ms * QUICK_SCREEN,
                "max_samples": GPU_BOUND_SAMPLES}
    return {"stop_above_ms": best_ms * TUNE_CUTOFF, "screen_above_ms": None}


def _warm_up(request: dict) -> None:
    """What every first request pays, paid ahead: the CUDA context on the device, the native launch library,
    cuBLAS's handle and the random-number kernels that make the inputs."""
    config.cache_dir = request["cache_dir"]
    if request.get("device") is None or not torch.cuda.is_available():
        return          # a CPU problem's child: its start (the imports) was the warm-up
    torch.cuda.set_device(request["device"])
    fastpath.load_if_built()
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
