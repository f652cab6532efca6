"""Verify and time candidates of any backend in a child process (`python -m backends.isolated_child`).

A kernel that faults (illegal address) poisons its CUDA context for good, so it must not run in the caller.
Backends whose `isolated` attribute is set (CUTLASS's) measure their runners here.
The parent keeps one child per process and sends it one JSON request per line on stdin; the child answers one tagged
JSON line per event on stdout: {"start": name} before touching a candidate, then {"name", "timing"} or
{"name", "error"}, and a tagged `done` line after the request. When the child dies or times out, the candidate that
started without an answer is the culprit; the rest run in a fresh child.
The checks and timing are kernels.verify and kernels.timing, exactly as in-process tuning uses them.

`FAULT_INJECTION = <choice name>` (set in the parent, passed in the request) makes the child kill itself (SIGSEGV)
when it starts that candidate, so the isolation itself can be tested on any machine.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from backends import get_backend
from kernels.core.cache_root import cache_root
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.helper_env import child_environment
from kernels.core.problem import GemmProblem
from kernels.core.toolchain import REPO_ROOT
from kernels.measure.timing import Timing, measure, user_call
from kernels.measure.verify import make_inputs, reference, timing_sets, verify_launch
from kernels.native import fastpath

TAG = "@@kernels-child "
DONE = "done"                       # after TAG: the child has answered the whole request
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


class _Worker:
    """One child that serves requests, one JSON line each, until it dies or is closed: its start (a Python process,
    torch, a CUDA context) is paid once per process rather than once per tune. After a fault it is discarded and the
    rest of the request goes to a fresh one."""

    def __init__(self, warm: dict | None = None):
        # stderr to a file: a pipe nobody reads while the child works could fill and stall it
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "backends.isolated_child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1,
                                     cwd=str(REPO_ROOT), env=child_environment())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        # a warm-up request queued at once: the child's CUDA context and libraries come up while the caller works
        self.warming = warm is not None and self._write(warm)

    def _write(self, request: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def warmed(self, timeout_s: float) -> str:
        """Wait for the warm-up request's answer (it comes before any other): "done" (or nothing was queued),
        "died" or "timed out" (then the child is to be ended: its next answer could be the warm-up's)."""
        if not self.warming:
            return "done"
        _, ended = self._answer(time.monotonic() + timeout_s)
        self.warming = False
        return ended

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)                 # end of output: the child is gone

    def ask(self, request: dict, timeout_s: float) -> tuple[str, str]:
        """(the child's output for this request, how it ended: "done", "died" or "timed out")."""
        if not self._write(request):
            return "", "died"
        return self._answer(time.monotonic() + timeout_s)

    def _answer(self, deadline: float) -> tuple[str, str]:
        out: list[str] = []
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return "".join(out), "timed out"
            if line is None:
                return "".join(out), "died"
            if line.startswith(TAG + DONE):
                return "".join(out), "done"
            out.append(line)

    def end(self, kill: bool) -> tuple[int | None, str]:
        """Stop the child (kill it, or let it read the end of its input); (its exit status, its stderr's tail)."""
        try:
            if kill:
                self.proc.kill()
            else:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.stderr.seek(0)
        tail = self.stderr.read()[-STDERR_TAIL:]
        self.stderr.close()
        return self.proc.returncode, tail


_worker: _Worker | None = None
_worker_lock = threading.Lock()


def close_worker() -> None:
    """End this process's child, if one runs (at exit; tests)."""
    global _worker
    with _worker_lock:
        if _worker is not None:
            _worker.end(kill=False)
            _worker = None


atexit.register(close_worker)


def prestart(device: int | None = None) -> None:
    """Start this process's child now, so its start-up (a Python process, torch) overlaps what the caller does next
    rather than the first isolated tune (a tuning worker calls this as it starts). With a CUDA `device` the child
    also brings up its context and libraries there at once (`warmed` waits for that)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            warm = None if device is None else {"warmup": True, "device": device, "cache_dir": str(cache_root())}
            _worker = _Worker(warm)


def warmed(timeout_s: float = CHILD_TIMEOUT_S) -> str:
    """Wait until the prestarted child has finished its warm-up: "done" (or none pending), "died" or "timed out"
    (either way that child is ended, and the first isolated tune starts a fresh one)."""
    with _worker_lock:
        return _settle_warm_up(timeout_s)


def _settle_warm_up(timeout_s: float) -> str:
    global _worker
    if _worker is None:
        return "done"
    ended = _worker.warmed(timeout_s)
    if ended != "done":
        _worker.end(kill=True)
        _worker = None
    return ended


def run_isolated(backend: str, problem, choices, budget_ms: float, timeout_s: float) -> dict:
    """name -> kernels.timing.Timing, or name -> failure text, for every choice of `backend`. Never raises for a
    kernel's fault."""
    global _worker
    results: dict = {}
    remaining = list(choices)
    seed = int(time.time_ns() % (1 << 31))
    with _worker_lock:
        _settle_warm_up(timeout_s)
        while remaining:
            request = {"backend": backend, "problem": json.loads(problem.key()),
                       "choices": [c.as_dict() for c in remaining], "budget_ms": budget_ms, "seed": seed,
                       "device": torch.cuda.current_device() if torch.cuda.is_available() else 0,
                       "cache_dir": str(cache_root()), "fault": FAULT_INJECTION}
            if _worker is None:
                _worker = _Worker()
            stdout, ended = _worker.ask(request, timeout_s)
            why = ""
            if ended != "done":
                status, stderr = _worker.end(kill=True)
                _worker = None
                why = (f"timed out after {timeout_s:.0f} s in the isolated child" if ended == "timed out" else
                       f"isolated child exited with status {status}: {stderr.strip()}")
            answers, in_flight = _parse(stdout)
            for name, msg in answers.items():
                results[name] = Timing(**msg["timing"]) if "timing" in msg else str(msg.get("error", "no error text"))
            if in_flight is not None and in_flight not in results:
                results[in_flight] = f"crashed: {why or 'no answer from the isolated child'}"
            left = [c for c in remaining if c.name not in results]
            if len(left) == len(remaining):   # no progress at all: the child cannot start; do not loop
                for c in left:
                    results[c.name] = f"not measured: {why or 'no answer from the isolated child'}"
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
    """One request: verify and time each choice, one tagged answer per event; non-zero when the context is gone."""
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

    operands = make_inputs(problem, device, seed=request["seed"])
    ref = reference(problem, *operands)
    sets = timing_sets(problem, device, operands, seed=request["seed"] + 1)
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
            why = verify_launch(launch, problem, operands, ref)
            if why is not None:
                _emit({"name": name, "error": why})
                if not context_alive(device):
                    return 3
                continue
            timing = measure(user_call(launch, sets), n_sets, device, budget_ms)
            _emit({"name": name, "timing": timing.as_dict()})
        except Exception as e:  # noqa: BLE001 - one candidate's failure is data
            _emit({"name": name, "error": f"crashed: {type(e).__name__}: {str(e)[:300]}"})
            if not context_alive(device):
                return 3      # the context is poisoned: the parent runs the rest in a fresh child
    return 0


def _warm_up(request: dict) -> None:
    """What every first request pays, paid ahead: the CUDA context on the device, the native launch library,
    cuBLAS's handle and the random-number kernels that make the inputs."""
    config.cache_dir = request["cache_dir"]
    if not torch.cuda.is_available():
        return
    torch.cuda.set_device(request["device"])
    fastpath.load_if_built()
    x = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    torch.mm(x, x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
