"""Spread a tuning run over a host's GPUs: one worker process per device, problems handed out one at a time.

Each worker sees only its own GPU (CUDA_VISIBLE_DEVICES), so no worker's context, memory or benchmark touches
another's device. The work is pulled, not pre-split: a worker gets its next problem when it answers the last, so a
slow problem never leaves the other GPUs idle. Compiles are shared through the one artifact store (its per-key locks
build a binary once for the host) and selections go through the one locked selection store; the workers' compile
pools share the CPU cores between them.

A worker that dies (killed, a faulting kernel, out of memory) is reported; the problem it held goes back to the
front of the queue for the others, and the device gets a fresh worker, up to RESTARTS times. A problem that took
MAX_ATTEMPTS workers down with it fails rather than going on killing the rest. ^C stops every worker (each runs in
its own session, so the terminal's signal reaches only this process, which then ends each worker's process group:
its compile pool and isolated child too) and reports what was left.

The protocol: the parent writes one JSON job per line on the worker's stdin ({"index", "job"}); the worker answers
one tagged JSON line per event on stdout ({"ready": true} once, then {"index", "result"} per job) and exits at
EOF on stdin. Anything else on its stdout is ignored; its stderr goes to a log file whose tail is reported when it
dies. This module holds only the scheduling: what a job is and how a worker runs it are the caller's.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TAG = "@@kernels-tune "
MAX_ATTEMPTS = 2        # workers a problem may take down before it is failed instead of handed to another
RESTARTS = 2            # fresh workers a device gets after its worker died; then the device is left out
STOP_GRACE_S = 5.0      # after SIGTERM, how long a worker's process group has before SIGKILL
LOG_TAIL = 1200         # characters of a dead worker's log kept in the report

# set in every process this starts: NVLink multicast off (NCCL, torch symmetric memory, NVSHMEM); on a shared
# multi-GPU host a program that uses it can put the GPUs out of service
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class GpuListError(ValueError):
    """--gpus names no usable device set."""


def parse_gpus(text: str, count: int) -> list[int]:
    """'all' or a comma list of device indices (as torch numbers the visible devices) -> the indices, distinct,
    in order. Errors name --gpus and what this host has."""
    have = f"this host has {count} visible GPU(s)" + (f": 0..{count - 1}" if count else "")
    if count == 0:
        raise GpuListError(f"--gpus {text}: no GPU visible (torch.cuda.device_count() is 0)")
    if text.strip() == "all":
        return list(range(count))
    picked: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise GpuListError(f"--gpus {text}: {part!r} is not a device index (expected 'all' or e.g. 0,1); {have}")
        index = int(part)
        if index >= count:
            raise GpuListError(f"--gpus {text}: device {index} does not exist; {have}")
        if index in picked:
            raise GpuListError(f"--gpus {text}: device {index} is listed twice")
        picked.append(index)
    return picked


def physical_device(index: int, visible: str | None) -> str:
    """What to put in a worker's CUDA_VISIBLE_DEVICES for torch's device `index`: the index itself, or the entry
    of this process's own CUDA_VISIBLE_DEVICES (an index or a GPU UUID) that torch numbers `index`."""
    if not visible:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    return entries[index]


@dataclass
class Result:
    """What came of one job: the worker's answer, or why there is none."""
    index: int
    device: int | None
    answer: dict | None = None        # the worker's result object
    failed: str = ""                  # the problem itself failed (it took workers down with it)
    left: str = ""                    # not run: time limit, interrupt, no worker left


@dataclass
class DeviceLog:
    """One device's share of the run, for the report."""
    device: int
    jobs: int = 0
    busy_s: float = 0.0               # seconds between handing out a job and its answer
    ready_s: list[float] = field(default_factory=list)    # each worker's start-up (imports, CUDA), as it reported
    deaths: list[str] = field(default_factory=list)


class Worker:
    """One worker process on one device, and the thread that turns its tagged stdout lines into events."""

    def __init__(self, device: int, argv: list[str], env: dict[str, str], log_path: Path,
                 events: "queue.Queue[tuple]"):
        self.device, self.log_path = device, log_path
        self.job: int | None = None
        self.job_started = 0.0
        self.stopping = False
        self.started = time.perf_counter()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                                         start_new_session=True, text=True, bufsize=1)
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events) -> None:
        for line in self.proc.stdout:
            if not line.startswith(TAG):
                continue
            try:
                message = json.loads(line[len(TAG):])
            except ValueError:
                continue
            if isinstance(message, dict):
                events.put(("message", self, message))
        events.put(("exit", self, self.proc.wait()))

    def send(self, index: int, job: dict) -> None:
        self.job, self.job_started = index, time.perf_counter()
        try:
            self.proc.stdin.write(json.dumps({"index": index, "job": job}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass                              # it died: its exit event hands the job back

    def finish(self) -> None:
        """No more jobs: the worker exits when it reads EOF."""
        self.stopping = True
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def kill(self, sig: int = signal.SIGTERM) -> None:
        """Signal the worker's whole process group (its compile pool and isolated child are in it)."""
        self.stopping = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def log_tail(self) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-LOG_TAIL:].strip()


def _describe_exit(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit status {code}"


class Pool:
    """Runs jobs on one worker per device. `start(device, events)` starts a Worker for a device (the caller decides
    its argv and environment); `jobs[i]` is the JSON-able job for index i."""

    def __init__(self, devices: list[int], start: Callable[[int, "queue.Queue[tuple]"], Worker],
                 on_result: Callable[[Result], None] | None = None, on_note: Callable[[str], None] | None = None):
        if not devices:
            raise GpuListError("no device to tune on")
        self.devices, self.start = devices, start
        self.on_result = on_result or (lambda r: None)
        self.on_note = on_note or (lambda text: None)
        self.logs = {d: DeviceLog(d) for d in devices}
        self.notes: list[str] = []
        self.stopped = ""

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self.on_note(text)

    def run(self, jobs: dict[int, dict], deadline: float | None = None, deadline_reason: str = "time limit reached",
            prepare: Callable[[], None] | None = None) -> dict[int, Result]:
        """Every job's Result; jobs are handed out in the dict's order (put the longest first: the last ones set
        when the run ends). `prepare()` runs after the workers are started and before any job is handed out (their
        start-up overlaps it). No job is handed out once time.perf_counter() passes `deadline` (the rest are left
        with `deadline_reason`); jobs in flight finish. ^C (KeyboardInterrupt) stops every worker and leaves what
        was not answered."""
        events: queue.Queue[tuple] = queue.Queue()
        todo = deque(jobs)
        attempts = {i: 0 for i in jobs}
        results: dict[int, Result] = {}
        restarts = {d: 0 for d in self.devices}
        workers: dict[int, Worker] = {}

        def out_of_time() -> bool:
            return deadline is not None and time.perf_counter() >= deadline

        def give_work(worker: Worker) -> None:
            if todo and not out_of_time():
                index = todo.popleft()
                worker.send(index, jobs[index])
            else:
                worker.job = None
                worker.finish()

        def record(result: Result) -> None:
            results[result.index] = result
            self.on_result(result)

        try:
            for device in self.devices:
                workers[device] = self.start(device, events)
            if prepare is not None:
                prepare()
            for worker in list(workers.values()):
                give_work(worker)
            while workers:
                try:
                    kind, worker, payload = events.get(timeout=0.5)     # a timeout keeps ^C prompt
                except queue.Empty:
                    continue
                if workers.get(worker.device) is not worker:
                    continue                                  # a replaced worker's late event
                if kind == "message":
                    self._on_message(worker, payload, record, give_work)
                    continue
                # the worker exited
                del workers[worker.device]
                if worker.stopping and worker.job is None and payload == 0:
                    continue                                  # done: EOF on its stdin
                self._on_death(worker, payload, todo, attempts, record)
                # a fresh worker on its device, else on one whose worker already finished, while restarts are left
                spare = [d for d in [worker.device, *self.devices] if d not in workers and restarts[d] < RESTARTS]
                if todo and spare and not out_of_time():
                    restarts[spare[0]] += 1
                    workers[spare[0]] = self.start(spare[0], events)
                    give_work(workers[spare[0]])
                elif todo and not workers:
                    self.stopped = "every worker died"
        except KeyboardInterrupt:
            self.stopped = "interrupted"
            self._stop_all(list(workers.values()))
            for worker in workers.values():
                if worker.job is not None and worker.job not in results:
                    todo.appendleft(worker.job)
        why = self.stopped or (deadline_reason if todo else "")
        if todo and not self.stopped:
            self.stopped = why
        for index in todo:
            if index not in results:
                record(Result(index, None, left=why))
        return results

    def _on_message(self, worker: Worker, message: dict, record, give_work) -> None:
        log = self.logs[worker.device]
        if "ready" in message:
            log.ready_s.append(time.perf_counter() - worker.started)
            return
        index = message.get("index")
        if index != worker.job or not isinstance(message.get("result"), dict):
            return                                            # not the answer to what it holds: ignored
        log.jobs += 1
        log.busy_s += time.perf_counter() - worker.job_started
        worker.job = None
        record(Result(index, worker.device, answer=message["result"]))
        give_work(worker)

    def _on_death(self, worker: Worker, code: int, todo: deque, attempts: dict[int, int], record) -> None:
        tail = worker.log_tail()
        what = f"the worker on GPU {worker.device} died ({_describe_exit(code)})"
        if worker.job is None:
            self._note(f"{what} between problems" + (f"; its log ends: {tail}" if tail else ""))
        else:
            attempts[worker.job] += 1
            if attempts[worker.job] >= MAX_ATTEMPTS:
                record(Result(worker.job, worker.device,
                              failed=f"{what} while tuning it, the {attempts[worker.job]}th worker to die on it; "
                                     f"not handed to another" + (f" (log: {tail[-400:]})" if tail else "")))
                self._note(f"{what}; its problem #{worker.job} failed (it took {MAX_ATTEMPTS} workers down)")
            else:
                todo.appendleft(worker.job)
                self._note(f"{what} while tuning problem #{worker.job}: handed back to the queue"
                           + (f"; its log ends: {tail[-400:]}" if tail else ""))
        self.logs[worker.device].deaths.append(_describe_exit(code))

    @staticmethod
    def _stop_all(workers: list[Worker]) -> None:
        for worker in workers:
            worker.kill(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for worker in workers:
            try:
                worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                worker.kill(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=STOP_GRACE_S)
            worker.kill(signal.SIGKILL)                   # what is left of its group (compile workers) goes too


def emit(message: dict) -> None:
    """The worker's side: one tagged line on stdout."""
    sys.stdout.write(TAG + json.dumps(message) + "\n")
    sys.stdout.flush()
