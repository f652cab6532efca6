"""`python -m kernels.dispatch.tune_worker`: one GPU's worker for `python -m kernels tune --gpus` (kernels.tune.gpu_pool
starts it with CUDA_VISIBLE_DEVICES naming its one device).

It reads jobs from stdin, one JSON line each ({"index", "job": {"line", "where"}}: the problem as a trace line),
looks each up exactly as the single-process run does (kernels.dispatch.record.replay: memory -> store -> tune) and
answers with gpu_pool's tagged lines: {"ready": true} once torch, CUDA and its isolated child are up, then per job
{"index", "result": {"status", "seconds", "reason", "selection"}}. It exits at EOF on stdin; when its parent dies
(the kernel sends it SIGKILL: PR_SET_PDEATHSIG); and after a job that left its CUDA context unusable (a faulting
kernel's sticky error would fail every later problem here; exit status 3 makes the pool re-queue nothing and start a
fresh worker). The answers go to a private copy of the original stdout, and stdout itself to stderr, so nothing the
libraries print can split a message.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

import torch

from backends import get_backend, isolated_child
from kernels.core.config import config
from kernels.core.problem import probe_problem
from kernels.dispatch import record
from kernels.tune import offline, problem_list
from kernels.tune.gpu_pool import emit


def answer(item: problem_list.Listed) -> dict:
    outcome = offline.tune_one(item, record.replay)
    return {"status": outcome.status, "seconds": outcome.seconds, "reason": outcome.reason,
            "selection": outcome.selection.to_dict() if outcome.selection is not None else None}


def _prestart_isolated(arch: int, device_name: str) -> bool:
    """Start the isolated child, warming up on this GPU, when a backend that benchmarks in it (CUTLASS) can serve
    the GPU: its start-up (imports, CUDA context, cuBLAS) then overlaps this worker's, instead of adding ~4.5 s to the
    first problem each worker tunes (measured on 4xH200)."""
    probe = probe_problem(arch, device_name)
    for name in config.backends:
        backend = get_backend(name)
        if backend.isolated and backend.available(probe)[0]:
            isolated_child.prestart(torch.cuda.current_device())
            return True
    return False


PR_SET_PDEATHSIG = 1
CONTEXT_LOST = 3


def _die_with_parent() -> None:
    """Linux: SIGKILL when the parent dies, so a parent killed by anything (SIGKILL included) leaves no worker."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:           # it died before the request took effect
        os._exit(1)


def _protocol_channel():
    """A private copy of stdout for the answers; fd 1 then points at stderr (the log)."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return channel


def main() -> int:
    _die_with_parent()
    channel = _protocol_channel()
    where = offline.target()
    if where is None:
        print(f"kernels tune worker: no GPU visible here (CUDA_VISIBLE_DEVICES="
              f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})", file=sys.stderr)
        return 2
    ready = {"ready": True, "device_name": where[2]}
    if where[0] == "cuda":
        child = _prestart_isolated(where[1], where[2])
        torch.ones(1, device="cuda")              # the context now, so `ready` covers the start-up
        if child:
            start = time.perf_counter()
            ready["child"] = isolated_child.warmed()
            ready["child_wait_s"] = round(time.perf_counter() - start, 3)
    emit(channel, ready)
    for raw in sys.stdin:
        try:
            message = json.loads(raw)
            index, job = message["index"], message["job"]
            item = problem_list.retarget([problem_list.from_line(job["line"], job["where"])], *where)[0]
        except (ValueError, KeyError, TypeError) as e:
            print(f"kernels tune worker: bad job {raw[:200]!r}: {e}", file=sys.stderr)
            return 2
        emit(channel, {"index": index, "result": answer(item)})
        if not isolated_child.context_alive(where[0]):
            print("kernels tune worker: the CUDA context is unusable after this problem; exiting for a fresh worker",
                  file=sys.stderr)
            return CONTEXT_LOST
    return 0


if __name__ == "__main__":
    sys.exit(main())
