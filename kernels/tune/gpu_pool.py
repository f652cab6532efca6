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
EOF on stdin. A worker gets its first job once it is ready, so one that cannot start is its device's failure, never
a problem's. Untagged output is ignored; its stderr goes to a log file (one per worker start) whose tail is reported
when it dies. A worker not ready within READY_TIMEOUT_S, or on one job longer than JOB_TIMEOUT_S, is killed as hung.
Whatever ends the run (^C, an error, the caller's SIGTERM turned into KeyboardInterrupt) ends every worker's group.
This module holds only the scheduling: what a job is and how a worker runs it are the caller's.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
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
READY_TIMEOUT_S = 180.0     # a worker not up by then (imports, CUDA context) is killed: its device's fault
# a job running longer is killed as hung and handed back: far above a tune's worst case, which may wait out another
# process's lock (kernels.core.fsutil.LOCK_TIMEOUT_S, 600 s) and an isolated child's limit (300 s)
JOB_TIMEOUT_S = 1500.0

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
        if not (part.isascii() and part.isdigit()):
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
    """One worker process on one device, and the thread that turns its tagged output lines into events."""

    def __init__(self, device: int, argv: list[str], env: dict[str, str], log_path: Path,
                 events: "queue.Queue[tuple]", cwd: str | None = None):
        self.device, self.log_path = device, log_path
        self.job: int | None = None
        self.job_started = 0.0
        self.ready = False
        self.stopping = False
        self.hung_killed = False
        self.started = self.ready_at = time.perf_counter()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # the log is ours alone: created 0600, never through a link planted at its path
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fd, env=env,
                                         cwd=cwd, start_new_session=True, text=True, bufsize=1)
        finally:
            os.close(fd)
        self._reader = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._reader.start()

    def _read(self, events) -> None:
        for line in self.proc.stdout:
            at = line.find(TAG)                   # a message may follow stray output that lacked its newline
            if at < 0:
                continue
            try:
                message = json.loads(line[at + len(TAG):])
            except ValueError:
                continue
            if isinstance(message, dict):
                if "ready" in message:
                    self.ready_at = time.perf_counter()      # when it said so, not when the loop got to it
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
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def hung(self, now: float) -> str:
        """Why this worker is to be killed as hung, or ''."""
        if not self.ready and now - self.started > READY_TIMEOUT_S:
            return f"not ready after {READY_TIMEOUT_S:.0f} s"
        if self.job is not None and now - self.job_started > JOB_TIMEOUT_S:
            return f"no answer after {JOB_TIMEOUT_S:.0f} s on one problem"
        return ""

    def drop_log(self) -> None:
        """Remove this worker's log: it ended with nothing worth keeping (clean, or never used)."""
        with contextlib.suppress(OSError):
            self.log_path.unlink()

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - LOG_TAIL))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""


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
                 on_result: Callable[[Result], None] | None = None, on_note: Callable[[str], None] | None = None,
                 events: "queue.Queue[tuple] | None" = None):
        if not devices:
            raise GpuListError("no device to tune on")
        self.devices, self.start = devices, start
        self._events: queue.Queue[tuple] = events if events is not None else queue.Queue()   # every worker's
        self.on_result = on_result or (lambda r: None)
        self.on_note = on_note or (lambda text: None)
        self.logs = {d: DeviceLog(d) for d in devices}
        self.notes: list[str] = []
        self.stopped = ""

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self.on_note(text)

    def run(self, jobs: dict[int, dict], deadline: float | None = None, deadline_reason: str = "time limit reached",
            prepare: Callable[[], None] | None = None, started: dict[int, Worker] | None = None) -> dict[int, Result]:
        """Every job's Result; jobs are handed out in the dict's order (put the longest first: the last ones set
        when the run ends). `started` holds workers already started for some devices (on this pool's events
        queue); the others are started here. `prepare()` runs after the workers are started and before any job is
        handed out (their start-up overlaps it). No job is handed out once time.perf_counter() passes `deadline`
        (the rest are left with `deadline_reason`); jobs in flight finish. ^C (KeyboardInterrupt) stops every worker
        and leaves what was not answered; any other exception stops them too, then propagates."""
        started = dict(started or {})
        self._todo = deque(jobs)
        self._jobs, self._deadline = jobs, deadline
        self._attempts = {i: 0 for i in jobs}
        self._results: dict[int, Result] = {}
        self._restarts = {d: 0 for d in self.devices}
        self._workers: dict[int, Worker] = {}
        self._prepared = prepare is None
        ended_clean: list[Worker] = []
        try:
            for device in self.devices:
                self._workers[device] = started.pop(device, None) or self.start(device, self._events)
            if prepare is not None:
                prepare()
            self._prepared = True
            for worker in list(self._workers.values()):
                if worker.ready:
                    self._give_work(worker)
            while self._workers and not self._all_answered():
                self._step()
            # holding nothing, never killed as hung, not dead (a worker still starting up when the last answer came
            # is no failure): their logs say nothing worth keeping
            ended_clean = [w for w in self._workers.values() if not w.hung_killed and w.proc.poll() in (None, 0)]
        except KeyboardInterrupt:
            self.stopped = "interrupted"
        finally:
            stop_workers([*self._workers.values(), *started.values()])
        for worker in ended_clean:
            worker.drop_log()                         # it answered all it was given
        self._drain()
        for worker in self._workers.values():
            if worker.job is not None and worker.job not in self._results:
                self._todo.appendleft(worker.job)
        if self._todo and not self.stopped:
            self.stopped = deadline_reason if self._out_of_time() else "every worker died"
        for index in self._todo:
            if index not in self._results:
                self._record(Result(index, None, left=self.stopped))
        return self._results

    def _drain(self) -> None:
        """Answers that arrived while the run was being stopped: their selections are stored, so they count."""
        while True:
            try:
                kind, worker, payload = self._events.get_nowait()
            except queue.Empty:
                return
            if kind == "message" and worker.job is not None and payload.get("index") == worker.job and \
                    isinstance(payload.get("result"), dict):
                self._record(Result(worker.job, worker.device, answer=payload["result"]))
                worker.job = None

    def _all_answered(self) -> bool:
        """Nothing left to hand out (or no time to) and nothing in flight: the workers' exits are not waited for
        (ending a worker waits for its isolated child and its interpreter's teardown: seconds on every run)."""
        return (not self._todo or self._out_of_time()) and all(w.job is None for w in self._workers.values())

    def _out_of_time(self) -> bool:
        return self._deadline is not None and time.perf_counter() >= self._deadline

    def _record(self, result: Result) -> None:
        self._results[result.index] = result
        self.on_result(result)

    def _give_work(self, worker: Worker) -> None:
        if self._todo and not self._out_of_time():
            index = self._todo.popleft()
            worker.send(index, self._jobs[index])
        else:
            worker.job = None
            worker.finish()

    def _step(self) -> None:
        try:
            kind, worker, payload = self._events.get(timeout=0.5)     # a timeout keeps ^C prompt
        except queue.Empty:
            now = time.perf_counter()
            for w in list(self._workers.values()):
                why = w.hung(now)
                if why and not w.stopping:
                    self._note(f"the worker on GPU {w.device} is {why}: killed")
                    w.stopping = w.hung_killed = True
                    w.kill(signal.SIGKILL)
            return
        if self._workers.get(worker.device) is not worker:
            return                                    # a replaced worker's late event
        if kind == "message":
            self._on_message(worker, payload)
            return
        del self._workers[worker.device]              # it exited
        if worker.job is None and payload == 0 and worker.ready:
            worker.drop_log()                         # done (EOF on its stdin)
            return
        self._on_death(worker, payload)
        # a fresh worker on its device, else on one whose worker already finished, while restarts are left
        spare = [d for d in [worker.device, *self.devices] if d not in self._workers and
                 self._restarts[d] < RESTARTS]
        if self._todo and spare and not self._out_of_time():
            self._restarts[spare[0]] += 1
            self._workers[spare[0]] = self.start(spare[0], self._events)

    def _on_message(self, worker: Worker, message: dict) -> None:
        log = self.logs[worker.device]
        if "ready" in message:
            if not worker.ready:
                worker.ready = True
                log.ready_s.append(worker.ready_at - worker.started)
                if self._prepared:
                    self._give_work(worker)
            return
        index = message.get("index")
        if index != worker.job or not isinstance(message.get("result"), dict):
            return                                            # not the answer to what it holds: ignored
        log.jobs += 1
        log.busy_s += time.perf_counter() - worker.job_started
        worker.job = None
        self._record(Result(index, worker.device, answer=message["result"]))
        self._give_work(worker)

    def _on_death(self, worker: Worker, code: int) -> None:
        tail = worker.log_tail()
        what = f"the worker on GPU {worker.device} died ({_describe_exit(code)})"
        self.logs[worker.device].deaths.append(_describe_exit(code))
        if not worker.ready:
            self._note(f"{what} before it was ready (its device's fault, no problem's)"
                       + (f"; its log ends: {tail[-400:]}" if tail else ""))
            return
        job = worker.job
        if job is None:
            self._note(f"{what} between problems" + (f"; its log ends: {tail[-400:]}" if tail else ""))
            return
        self._attempts[job] += 1
        if self._attempts[job] >= MAX_ATTEMPTS:
            self._record(Result(job, worker.device,
                                failed=f"{what} while tuning it; {self._attempts[job]} workers died on it, so it "
                                       f"is not handed to another" + (f" (log: {tail[-400:]})" if tail else "")))
            self._note(f"{what}; its problem #{job} failed ({MAX_ATTEMPTS} workers died on it)")
        else:
            self._todo.appendleft(job)
            self._note(f"{what} while tuning problem #{job}: handed back to the queue"
                       + (f"; its log ends: {tail[-400:]}" if tail else ""))


def stop_workers(workers: list[Worker]) -> None:
    """Every worker's group ended: SIGTERM, a grace period, then SIGKILL (also for what is left of a group whose
    leader exited: a compile worker)."""
    for worker in workers:
        worker.stopping = True
        worker.kill(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in workers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        worker.kill(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.proc.wait(timeout=STOP_GRACE_S)


@contextlib.contextmanager
def terminations_as_interrupt():
    """SIGTERM and SIGHUP (a closed terminal) raise KeyboardInterrupt while the block runs, so a run stopped by
    either ends its workers as ^C does (main thread only; elsewhere the block changes nothing; a signal the process
    ignores, as under nohup, is left ignored)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # a signal the caller ignores stays ignored: under nohup a closed terminal must not stop the run
    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def emit(channel, message: dict) -> None:
    """The worker's side: one tagged line on its protocol channel (a copy of its original stdout)."""
    channel.write(TAG + json.dumps(message) + "\n")
    channel.flush()
