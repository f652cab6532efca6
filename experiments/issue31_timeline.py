"""Issue 31: where the wall time of `python -m kernels tune --gpus` goes. Runs the command in this process (the same
`kernels.__main__.main`) and writes a timeline of the parent's events, in seconds from the moment the shell started
this process (ISSUE31_T0_NS: `date +%s%N` taken just before), as JSON lines:

    ISSUE31_T0_NS=$(date +%s%N) python -m experiments.issue31_timeline TIMELINE.jsonl -- tune LIST --gpus all

Events: the CLI's imports done, workers started before torch (or not), the pool created (torch loaded, lists read,
store checked), each worker started / ready (with its isolated child's warm-up wait) / exited, each problem handed out and answered (with its tune's
stage seconds as the worker's selection records them), the CUTLASS prepare step, the pool's end, the report printed.
The shell adds the end of the process. The wrappers only record: the command runs unchanged.
"""
from __future__ import annotations

import json
import os
import sys
import time

T0 = int(os.environ.get("ISSUE31_T0_NS") or time.time_ns()) / 1e9
EVENTS: list[dict] = []


def mark(event: str, **fields) -> None:
    EVENTS.append(dict(t=round(time.time() - T0, 3), event=event, **fields))


mark("python up")
from kernels import __main__ as cli  # noqa: E402 - the imports are what is timed (the CLI's own: no torch)
from kernels.tune import gpu_pool, worker_launch  # noqa: E402

mark("imports done")


def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if before is not None:
            before(*args, **kwargs)
        result = original(*args, **kwargs)
        if after is not None:
            after(result, *args, **kwargs)
        return result
    setattr(owner, name, wrapper)


def _stages(message: dict) -> dict:
    sel = (message.get("result") or {}).get("selection") or {}
    return {"seconds": (message.get("result") or {}).get("seconds"), "stages": sel.get("stage_seconds")}


wrap(gpu_pool.Worker, "__init__", after=lambda r, self, device, *a, **k: mark("worker started", gpu=device))
wrap(gpu_pool.Worker, "send", before=lambda self, index, job: mark("job handed", gpu=self.device, index=index))
def _ready(message: dict) -> dict:
    return {k: message[k] for k in ("child", "child_wait_s") if k in message}


wrap(gpu_pool.Pool, "_on_message", before=lambda self, worker, message: mark(
    "ready" if "ready" in message else "answer", gpu=worker.device, index=message.get("index"),
    **(_ready(message) if "ready" in message else _stages(message))))
wrap(gpu_pool.Pool, "__init__", before=lambda self, *a, **k: mark("pool created (torch, lists, store checked)"))
wrap(worker_launch, "start_early", after=lambda r, *a, **k: mark(
    "early workers started" if r is not None else "no early start"))
wrap(gpu_pool.Pool, "_on_death", before=lambda self, worker, code: mark("worker died", gpu=worker.device, code=code))
wrap(gpu_pool.Pool, "run", before=lambda self, *a, **k: mark("pool run"), after=lambda r, self, *a, **k: mark(
    "pool done (every worker exited)"))
wrap(gpu_pool.Worker, "finish", before=lambda self: mark("worker told to finish", gpu=self.device))


def main() -> int:
    out, argv = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    mark("main")
    try:
        return cli.main(argv)
    finally:
        mark("report printed")
        with open(out, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in EVENTS)


if __name__ == "__main__":
    sys.exit(main())
