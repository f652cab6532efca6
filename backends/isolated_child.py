"""Verify and time candidates of any backend in a child process (`python -m backends.isolated_child`).

A kernel that faults (illegal address) poisons its CUDA context for good, so it must not run in the caller.
Backends whose `isolated` attribute is set (CUTLASS's) measure their runners here.
The parent sends one JSON request on stdin; the child answers one tagged JSON line per event on stdout:
{"start": name} before touching a candidate, then {"name", "timing"} or {"name", "error"}. When the child dies or
times out, the candidate that started without an answer is the culprit; the rest run in a fresh child.
The checks and timing are kernels.verify and kernels.timing, exactly as in-process tuning uses them.

`FAULT_INJECTION = <choice name>` (set in the parent, passed in the request) makes the child kill itself (SIGSEGV)
when it starts that candidate, so the isolation itself can be tested on any machine.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from backends import get_backend
from kernels.core.cache_root import cache_root
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.problem import GemmProblem
from kernels.core.toolchain import REPO_ROOT
from kernels.measure.timing import Timing, measure, user_call
from kernels.measure.verify import make_inputs, reference, timing_sets, verify_launch
from kernels.native import fastpath

TAG = "@@kernels-child "
STDERR_TAIL = 1500
# Seconds an isolated verify-and-time child may run before it is killed. The child compiles nothing (it loads what the
# parent built), so this only bounds a hung kernel: far above a dozen candidates at KERNELS_BENCH_MS each, with the
# child's imports and CUDA start
CHILD_TIMEOUT_S = 300.0
# Tests only: the choice name at which the child kills itself (None: no fault)
FAULT_INJECTION: str | None = None


def _emit(obj: dict) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


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
        elif "name" in msg:
            answers[msg["name"]] = msg
            if in_flight == msg["name"]:
                in_flight = None
    return answers, in_flight


def child_environment() -> dict:
    """Environment for helper processes: the checkout importable, the parent's cache and device choice kept."""

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["KERNELS_CACHE_DIR"] = str(cache_root())     # the checked directory (or the private fallback)
    return env


def run_isolated(backend: str, problem, choices, budget_ms: float, timeout_s: float) -> dict:
    """name -> kernels.timing.Timing, or name -> failure text, for every choice of `backend`. Never raises for a
    kernel's fault."""

    results: dict = {}
    remaining = list(choices)
    seed = int(time.time_ns() % (1 << 31))
    while remaining:
        request = {"backend": backend, "problem": json.loads(problem.key()),
                   "choices": [c.as_dict() for c in remaining], "budget_ms": budget_ms, "seed": seed,
                   "device": torch.cuda.current_device() if torch.cuda.is_available() else 0,
                   "cache_dir": str(cache_root()), "fault": FAULT_INJECTION}
        proc = subprocess.Popen([sys.executable, "-m", "backends.isolated_child"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
                                env=child_environment())
        timed_out = False
        try:
            stdout, stderr = proc.communicate(json.dumps(request), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.kill()
            stdout, stderr = proc.communicate()
        answers, in_flight = _parse(stdout)
        for name, msg in answers.items():
            results[name] = Timing(**msg["timing"]) if "timing" in msg else str(msg.get("error", "no error text"))
        why = (f"timed out after {timeout_s:.0f} s in the isolated child" if timed_out else
               f"isolated child exited with status {proc.returncode}: {stderr.strip()[-STDERR_TAIL:]}")
        if in_flight is not None and in_flight not in results:
            results[in_flight] = f"crashed: {why}"
        left = [c for c in remaining if c.name not in results]
        if len(left) == len(remaining):   # no progress at all: the child cannot start; do not loop
            for c in left:
                results[c.name] = f"not measured: {why}"
            break
        remaining = left
    return results


# -- child side -----------------------------------------------------------------------------------------------------
def _context_alive(device: str) -> bool:
    if device != "cuda":
        return True
    try:
        torch.cuda.synchronize()
        (torch.ones(1, device="cuda") + 1).item()
        return True
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


def main() -> int:
    request = json.loads(sys.stdin.read())
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

    a, b = make_inputs(problem, device, seed=request["seed"])
    ref = reference(problem, a, b)
    sets = timing_sets(problem, device, (a, b), seed=request["seed"] + 1)
    n_sets = len(sets)

    for outcome in outcomes:
        name = outcome.choice.name
        _emit({"start": name})
        if name == fault:
            os.kill(os.getpid(), signal.SIGSEGV)
        if outcome.runner is None:
            _emit({"name": name, "error": outcome.error or "build failed"})
            continue
        launch = outcome.runner.launch
        try:
            why = verify_launch(launch, problem, a, b, ref)
            if why is not None:
                _emit({"name": name, "error": why})
                if not _context_alive(device):
                    return 3
                continue
            timing = measure(user_call(launch, sets), n_sets, device, budget_ms)
            _emit({"name": name, "timing": timing.as_dict()})
        except Exception as e:  # noqa: BLE001 - one candidate's failure is data
            _emit({"name": name, "error": f"crashed: {type(e).__name__}: {str(e)[:300]}"})
            if not _context_alive(device):
                return 3      # the context is poisoned: the parent runs the rest in a fresh child
    return 0


if __name__ == "__main__":
    sys.exit(main())
