"""A stand-in for `python -m kernels.dispatch.tune_worker` that speaks its protocol without a GPU, for the scheduler
tests (kernels.tune.gpu_pool). Run as `python tests/fake_tune_worker.py DIR`; DIR holds its instructions:

- `die-on-<where>`: a worker given the problem listed at <where> kills itself (SIGKILL); with `once`, only the first
  worker to meet it (a marker file records that one died);
- `slow`: each job sleeps this many seconds;
- `grandchild`: each worker starts a `sleep 600` child first and appends its pid to `grandchildren` (what ^C must not
  leave behind);
- `artifacts`: every job builds the keys listed there through kernels.core.fsutil.build_each_once, appending each key
  it built to `builds`;
- `hang-on-<where>`: a worker given that problem sleeps for good (once, as `die-on-`);
- `no-start`: every worker exits with status 1 before it is ready; `no-ready`: it never says it is ready;
- `slow-exit`: at the end of its input a worker sleeps this many seconds before it exits (a real worker's teardown).
Each answer names the worker's CUDA_VISIBLE_DEVICES in its reason, and every job is appended to `jobs`.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

TAG = "@@kernels-tune "


def emit(obj: dict) -> None:
    sys.stdout.write(TAG + json.dumps(obj) + "\n")
    sys.stdout.flush()


def build_artifacts(base: Path) -> None:
    from kernels.core.fsutil import build_each_once

    keys = (base / "artifacts").read_text().split()

    def build(batch):
        with open(base / "builds", "a") as f:
            f.write("".join(f"{k}\n" for k in batch))
        time.sleep(0.3)
        for k in batch:
            (base / f"{k}.built").write_text("ok")

    build_each_once(keys, lambda k: base / "locks" / f"{k}.lock", lambda k: (base / f"{k}.built").exists(), build)


def main() -> int:
    base = Path(sys.argv[1])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if (base / "grandchild").exists():
        child = subprocess.Popen(["sleep", "600"])
        with open(base / "grandchildren", "a") as f:
            f.write(f"{child.pid}\n")
    if (base / "no-start").exists():
        return 1
    if (base / "no-ready").exists():
        time.sleep(600)
    print("noise on stdout that is not a message")
    sys.stdout.write("noise without its newline, then the message on the same line: ")
    emit({"ready": True})
    for raw in sys.stdin:
        job = json.loads(raw)
        where = job["job"]["where"]
        with open(base / "jobs", "a") as f:
            f.write(f"{visible} {where}\n")
        die = base / f"die-on-{where.replace('/', '_').replace(':', '_')}"
        if die.exists():
            marker = Path(str(die) + ".died")
            if not (die.read_text().strip() == "once" and marker.exists()):
                marker.write_text("x")
                os.kill(os.getpid(), signal.SIGKILL)
        hang = base / f"hang-on-{where.replace('/', '_').replace(':', '_')}"
        if hang.exists() and not Path(str(hang) + ".hung").exists():
            Path(str(hang) + ".hung").write_text("x")
            time.sleep(600)
        if (base / "slow").exists():
            time.sleep(float((base / "slow").read_text()))
        if (base / "artifacts").exists():
            build_artifacts(base)
        emit({"index": job["index"], "result": {"status": "tuned", "seconds": 0.01, "reason": f"gpu {visible}",
                                                 "selection": None}})
    if (base / "slow-exit").exists():
        time.sleep(float((base / "slow-exit").read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
