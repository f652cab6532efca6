"""The job loop of a `kernels tune --gpus` worker (kernels.dispatch.tune_worker starts the process, then loads this
module, and torch with it): each problem is looked up exactly as the single-process run does
(kernels.dispatch.record.replay: memory -> store -> tune) and answered on the protocol channel."""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from backends import child_handle, get_backend, isolated_child
from kernels.core.config import config
from kernels.core.problem import probe_problem
from kernels.dispatch import record
from kernels.tune import offline, problem_list
from kernels.tune.gpu_pool import emit

CONTEXT_LOST = 3
# how long `ready` waits for the isolated child's warm-up: well inside the pool's READY_TIMEOUT_S, so a child stuck
# warming up costs this worker its child (the first tune starts a fresh one), never the worker its GPU
CHILD_WARM_UP_S = 90.0


def answer(item: problem_list.Listed) -> dict:
    outcome = offline.tune_one(item, record.replay)
    return {"status": outcome.status, "seconds": outcome.seconds, "reason": outcome.reason,
            "selection": outcome.selection.to_dict() if outcome.selection is not None else None}


def _isolated_serves(arch: int, device_name: str) -> bool:
    """Whether a backend that measures in the isolated child (CUTLASS) serves this GPU."""
    probe = probe_problem(arch, device_name)
    for name in config.backends:
        backend = get_backend(name)
        if backend.isolated and backend.available(probe)[0]:
            return True
    return False


def serve(channel, jobs=None) -> int:
    """Say ready (torch, the CUDA context and the isolated child up), then answer each job read from `jobs` (stdin)
    until its end. 2: no GPU here or a bad job; 3: a job left the CUDA context unusable (a fresh worker follows)."""
    jobs = sys.stdin if jobs is None else jobs
    config.duel = "loop"        # no calls will follow an offline tune to run its duels on: they run in the tune
    where = offline.target()
    if where is None:
        print(f"kernels tune worker: no GPU visible here (CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})", file=sys.stderr)
        _end_child()
        return 2
    ready = {"ready": True, "device_name": where[2]}
    child = where[0] == "cuda" and _isolated_serves(where[1], where[2])
    if child:
        child_handle.prestart(torch.cuda.current_device())     # started already, unless CUTLASS was not listed
    else:
        _end_child()                              # started on the chance it was needed: it is not
    if where[0] == "cuda":
        torch.ones(1, device="cuda")              # this process's context now (the child warms up meanwhile)
    if child:
        start = time.perf_counter()
        ready["child"] = child_handle.warmed(CHILD_WARM_UP_S)
        ready["child_wait_s"] = round(time.perf_counter() - start, 3)
    emit(channel, ready)
    for raw in jobs:
        try:
            message = json.loads(raw)
            index, job = message["index"], message["job"]
            item = problem_list.retarget([problem_list.from_line(job["line"], job["where"])], *where)[0]
        except (ValueError, KeyError, TypeError) as e:
            print(f"kernels tune worker: bad job {raw[:200]!r}: {e}", file=sys.stderr)
            _end_child()
            return 2
        emit(channel, {"index": index, "result": answer(item)})
        if not isolated_child.context_alive(where[0]):
            print("kernels tune worker: the CUDA context is unusable after this problem; exiting for a fresh worker",
                  file=sys.stderr)
            return CONTEXT_LOST
    return 0


def _end_child() -> None:
    """Kill the isolated child now (the exit's own close would let a child still warming up finish first)."""
    with child_handle.lock:
        child_handle.discard(kill=True)
