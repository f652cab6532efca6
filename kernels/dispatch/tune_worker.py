"""`python -m kernels.dispatch.tune_worker`: one GPU's worker for `python -m kernels tune --gpus` (kernels.tune.gpu_pool
starts it with CUDA_VISIBLE_DEVICES naming its one device).

It reads jobs from stdin, one JSON line each ({"index", "job": {"line", "where"}}: the problem as a trace line),
looks each up exactly as the single-process run does (kernels.dispatch.tune_jobs) and answers with gpu_pool's tagged
lines: {"ready": true} once torch, CUDA and its isolated child are up, then per job
{"index", "result": {"status", "seconds", "reason", "selection"}}. It exits at EOF on stdin; when its parent dies
(the kernel sends it SIGKILL: PR_SET_PDEATHSIG); and after a job that left its CUDA context unusable (a faulting
kernel's sticky error would fail every later problem here; exit status 3 makes the pool re-queue nothing and start a
fresh worker). The answers go to a private copy of the original stdout, and stdout itself to stderr, so nothing the
libraries print can split a message.

This module imports no torch: it starts the isolated child (CUTLASS's time-and-verify process, which warms up on the
GPU) first, and only then loads the job loop and torch, so the two start-ups (seconds each) overlap.
"""
from __future__ import annotations

import ctypes
import importlib
import os
import signal
import sys

from backends import child_handle
from kernels.core.config import config

PR_SET_PDEATHSIG = 1
# the backend whose runners are timed and verified in the isolated child; the job loop checks it serves this GPU and
# ends the child otherwise
ISOLATED_BACKEND = "cutlass"
ONLY_DEVICE = 0          # CUDA_VISIBLE_DEVICES names one GPU: torch numbers it 0


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
    if ISOLATED_BACKEND in config.backends:
        child_handle.prestart(ONLY_DEVICE)
    return importlib.import_module("kernels.dispatch.tune_jobs").serve(channel)


if __name__ == "__main__":
    sys.exit(main())
