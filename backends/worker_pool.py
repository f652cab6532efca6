"""A pool of long-lived worker subprocesses speaking JSON lines over stdin/stdout.

Subprocesses started with `python -m module` (not multiprocessing) never re-import the user's __main__, never
inherit a CUDA context, and a worker that crashes costs one job, not the caller.
"""
from __future__ import annotations

import atexit
import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from kernels.core.toolchain import REPO_ROOT


class WorkerDied(RuntimeError):
    pass


class _Worker:
    def __init__(self, module: str, env: dict[str, str]):
        # `-m` puts the working directory first on the worker's path: run it from the package's root, so a module
        # planted in the caller's working directory (a json.py) is never imported by the worker
        self.proc = subprocess.Popen([sys.executable, "-m", module], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1, cwd=str(REPO_ROOT))

    def request(self, job: dict, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout_s):
                self.kill()
                raise TimeoutError(f"worker gave no answer within {timeout_s:.0f} s")
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise WorkerDied(f"worker exited with code {code}")
        return json.loads(line)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()


class WorkerPool:
    def __init__(self, module: str, env: dict[str, str], size: int):
        self.module, self.env, self.size = module, env, max(1, size)
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._started = 0
        self._lock = threading.Lock()
        self._all: list[_Worker] = []
        atexit.register(self.close)

    def _acquire(self) -> _Worker:
        with self._lock:
            if self._idle.empty() and self._started < self.size:
                self._started += 1
                worker = _Worker(self.module, self.env)
                self._all.append(worker)
                return worker
        return self._idle.get()

    def _release(self, worker: _Worker) -> None:
        if worker.alive():
            self._idle.put(worker)
        else:
            with self._lock:
                self._started -= 1
                self._all.remove(worker)

    def _run_one(self, job: dict, timeout_s: float) -> dict:
        worker = self._acquire()
        start = time.perf_counter()
        try:
            return worker.request(job, timeout_s)
        except (TimeoutError, WorkerDied, OSError, ValueError) as e:
            worker.kill()
            return {"id": job.get("id"), "ok": False, "error": f"{type(e).__name__}: {e}",
                    "seconds": time.perf_counter() - start}
        finally:
            self._release(worker)

    def map(self, jobs: list[dict], timeout_s: float = 600.0) -> list[dict]:
        """Run every job; results in job order. A job that kills its worker comes back as a failure."""
        if not jobs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.size, len(jobs))) as ex:
            return list(ex.map(lambda j: self._run_one(j, timeout_s), jobs))

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
            self._started = 0
        for w in workers:
            try:
                w.proc.stdin.close()
            except OSError:
                pass
            try:
                w.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                w.kill()
        self._idle = queue.Queue()


def worker_env(extra: dict[str, str], drop: tuple[str, ...] = ()) -> dict[str, str]:
    """The parent's environment with our import path, minus `drop`, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env
