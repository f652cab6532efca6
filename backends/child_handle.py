"""This process's handle on its isolated time-and-verify child (`python -m backends.isolated_child`): start it, ask
it one request at a time, end it. Free of torch, so a tuning worker can start its child before it imports torch
itself (the two start-ups, seconds each, then overlap); backends.isolated_child holds the requests and the child's
side. One child per process, behind `lock`.
"""
from __future__ import annotations

import atexit
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time

from kernels.core.cache_root import cache_root
from kernels.core.helper_env import child_environment
from kernels.core.toolchain import REPO_ROOT

TAG = "@@kernels-child "
DONE = "done"                       # after TAG: the child has answered the whole request
STDERR_TAIL = 1500
# Seconds an isolated time-and-verify child may run before it is killed. The child compiles nothing (it loads what the
# parent built), so this only bounds a hung kernel: far above a dozen candidates at KERNELS_BENCH_MS each, with the
# child's imports and CUDA start
CHILD_TIMEOUT_S = 300.0
# Seconds a child may take to answer its warm-up (a Python process, torch, a CUDA context: 5.1-5.4 s on an H200 host,
# thirty-fourth session) before `start_state` calls it hung, ends it and says so: a caller that does not wait for the
# start (a first tune leaving the child's candidates to the calls) would otherwise wait on calls for ever
START_LIMIT_S = 60.0
# How a result begins when the child gave none for a candidate (it could not start, or died before reaching it): a
# fault of the child, not of the candidate, recorded as the candidate's failure like any other
NOT_MEASURED = "not measured"


class Child:
    """One child that serves requests, one JSON line each, until it dies or is closed: its start (a Python process,
    torch, a CUDA context) is paid once per process rather than once per tune. After a fault it is discarded and the
    rest of the request goes to a fresh one."""

    def __init__(self, warm: dict | None = None):
        # stderr to a file: a pipe nobody reads while the child works could fill and stall it
        self.stderr = tempfile.TemporaryFile(mode="w+")
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "backends.isolated_child"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1,
                                         cwd=str(REPO_ROOT), env=child_environment())
        except BaseException:
            self.stderr.close()
            raise
        self.born = time.monotonic()
        self.lines: queue.Queue = queue.Queue()
        # set by the reader once the child has answered a first request (or ended): from then on a request to it waits
        # for the request, not for a start
        self.up = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        # a warm-up request queued at once: the child's CUDA context and libraries come up while the caller works
        self.warming = warm is not None and self._write(warm)
        self.warm_queued = self.warming       # its start is then bounded by START_LIMIT_S (`start_state`)

    def serving(self) -> bool:
        """Up (a first request answered) and not exited."""
        return self.up.is_set() and self.proc.poll() is None

    def _write(self, request: dict) -> bool:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return True
        except OSError:
            return False

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
            if line.startswith(TAG + DONE):
                self.up.set()
        self.lines.put(None)                 # end of output: the child is gone
        self.up.set()

    def warmed(self, timeout_s: float) -> str:
        """Wait for the warm-up request's answer (it comes before any other): "done" (or nothing was queued),
        "died" or "timed out" (then the child is to be ended: its next answer could be the warm-up's)."""
        if not self.warming:
            return "done"
        _, ended = self._answer(time.monotonic() + timeout_s)
        self.warming = False
        return ended

    def ask(self, request: dict, timeout_s: float) -> tuple[str, str]:
        """(the child's output for this request, how it ended: "done", "died" or "timed out"). A warm-up still
        pending is answered first, so its `done` is never taken for this request's."""
        if self.warming:
            ended = self.warmed(timeout_s)
            if ended != "done":
                return "", ended
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


_child: Child | None = None
lock = threading.RLock()        # held by whoever talks to the child: one request at a time per process


def current() -> Child | None:
    return _child


def started() -> Child:
    """The child, started now if none runs (hold `lock`)."""
    global _child
    if _child is None:
        _child = Child()
    return _child


def discard(kill: bool) -> tuple[int | None, str]:
    """End the child (hold `lock`): killed, or left to read the end of its input; (its exit status, stderr's tail)."""
    global _child
    child, _child = _child, None
    return child.end(kill) if child is not None else (None, "")


def close() -> None:
    """End this process's child, if one runs (at exit; tests)."""
    with lock:
        discard(kill=False)


atexit.register(close)


def prestart(device: int | None = None) -> None:
    """Start this process's child now, so its start-up (a Python process, torch) overlaps what the caller does next
    rather than the first isolated tune (a tuning worker calls this first thing). A warm-up request is queued at
    once: with a CUDA `device` the child also brings up its context and libraries there (`warmed` waits for that,
    `start_state` tells without waiting)."""
    global _child
    with lock:
        if _child is None:
            _child = Child({"warmup": True, "device": device, "cache_dir": str(cache_root())})


def start_state(device: int | None = None) -> str:
    """Where this process's child stands, without waiting and without raising: "up" (it answered its warm-up: a
    request then waits for itself, not for a start), "starting", or "failed: why" (it could not be started, has exited,
    or has not come up within START_LIMIT_S: then it is ended, so that a later tune starts a fresh one). When none
    runs, one is started (`prestart`)."""
    child = _child          # read without the lock: another thread may hold it for a request of seconds
    if child is not None:
        # `up` is also set at the end of its output, so a child that exits is seen once `up` is (no waitpid a call)
        # a child started by a request (no warm-up) is up once that request, which its holder bounds, is answered
        if not child.up.is_set() and (not child.warm_queued or time.monotonic() - child.born < START_LIMIT_S):
            return "starting"
        if child.serving():
            return "up"
        status = child.proc.poll()
        if not lock.acquire(blocking=False):
            return "starting"       # a request holds the child: it finds out, and ends it if need be
        try:
            if _child is not child or child.serving():
                return "starting"   # replaced or come up meanwhile: asked again on the next call
            discard(kill=True)
        finally:
            lock.release()
        if status is not None:
            return f"failed: the isolated child exited with status {status}"
        return f"failed: the isolated child did not come up within {START_LIMIT_S:.0f} s"
    if not lock.acquire(blocking=False):
        return "starting"       # a request holds the child's lock: it starts one
    try:
        prestart(device)
    except Exception as e:  # noqa: BLE001 - no process to be had (file descriptors, memory): said, not raised
        return f"failed: the isolated child could not be started ({type(e).__name__}: {e})"
    finally:
        lock.release()
    return "starting"


def serving() -> bool:
    """Whether a child runs, has come up and has not exited (hold `lock`: then no other thread ends it meanwhile)."""
    return _child is not None and _child.serving()


def warmed(timeout_s: float = CHILD_TIMEOUT_S) -> str:
    """Wait until the prestarted child has finished its warm-up: "done" (or none pending), "died" or "timed out"
    (either way that child is ended, and the first isolated tune starts a fresh one)."""
    with lock:
        if _child is None:
            return "done"
        ended = _child.warmed(timeout_s)
        if ended != "done":
            discard(kill=True)
        return ended
