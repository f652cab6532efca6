"""Background CUTLASS builds (KERNELS_CUTLASS_BUILD=background, the default): no tune waits on nvcc.

A tune whose CUTLASS candidates are not all built goes on with those that are (backends.cutlass hands the rest back
pending) and queues the problem and the choices it lacks (kernels.tune.build_queue.request), which starts this
builder unless one runs. The builder (`python -m kernels.tune.background_build`, detached: it outlives the process
that asked; os.nice(19); at most max(1, cores - 2) compiles at a time) builds what the requests ask first, then the
default set of each asking problem's arch and dtype (kernels.tune.warmup), looks at the queue again and exits when
nothing is left. The problem is marked pending in its Selection and re-tuned on its next cold lookup once its
binaries are built, or failed for good (backends.cutlass records a failed compile; background builds do not retry
it).

Files, under <cache dir>/cutlass/background/: the queue's (kernels.tune.build_queue), and state.json: what the
builder does or did last (pid, stage, done/total of its batch, compiled, failed), for `python -m kernels info`.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from backends import get_backend
from kernels.core import detached
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.fsutil import atomic_write_text, file_lock, read_json
from kernels.core.problem import GemmProblem
from kernels.tune.build_queue import Request, Where, builder_running, queued, where
from kernels.tune.warmup import default_set

# how long a builder waits for the lock before leaving the queue to the one that holds it: a requester or `kernels
# info` looking whether a builder runs holds it for microseconds, a builder for minutes
BUILDER_LOCK_WAIT_S = 2.0


def background_jobs() -> int:
    """Parallel compiles of a background build: MAX_JOBS, leaving two cores to the work that asked."""
    return max(1, min(config.max_jobs, (os.cpu_count() or 1) - 2))


def run_builder(w: Where, jobs: int | None = None) -> bool:
    """Build what is queued unless another builder holds the lock; True when this one built. Looks at the queue
    again after letting the lock go (see the module docstring)."""
    built = False
    while True:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(file_lock(w.lock, timeout_s=BUILDER_LOCK_WAIT_S))
            except TimeoutError:
                return built
            built = True
            handled = _drain(w, jobs or background_jobs())
        if not set(queued(w)) - handled:
            return built


@dataclass
class _State:
    """state.json: what this builder is doing, rewritten as it goes."""
    path: Path
    pid: int
    started: float
    stage: str = "starting"
    done: int = 0
    total: int = 0
    compiled: int = 0
    failed: int = 0
    finished: bool = False
    failed_keys: set[str] = field(default_factory=set)    # the failed binaries so far (`failed` counts them)

    def update(self, **changes) -> None:
        for name, value in changes.items():
            setattr(self, name, value)
        record = {k: v for k, v in asdict(self).items() if k not in ("path", "failed_keys")}
        with contextlib.suppress(OSError):              # a state that cannot be written only leaves info behind
            atomic_write_text(self.path, json.dumps(dict(record, updated=time.time())))


def _drain(w: Where, jobs: int) -> set[Path]:
    """New requests first, each time the queue is looked at (one batch for all of them), then the default set of
    each asking arch and dtype one problem at a time (a batch of at most CUTLASS_MAX_CONFIGS kernels, so a request
    that comes meanwhile waits for one batch, not for the whole set), until nothing is left. Returns the requests
    handled, removed last: a builder killed midway leaves them queued."""
    state = _State(w.state, os.getpid(), time.time())
    handled: dict[Path, Request] = {}
    sets: set[tuple[int, str]] = set()
    todo: list[tuple[str, GemmProblem, list[Choice]]] = []      # the default sets' problems not built yet
    while True:
        fresh = {p: r for p, r in queued(w).items() if p not in handled}
        if fresh:
            _build(state, f"{len(fresh)} asking problem(s)", [(r.problem, list(r.choices)) for r in fresh.values()],
                   jobs)
            handled.update(fresh)
            for r in fresh.values():
                if (r.problem.arch, r.problem.dtype) not in sets:
                    sets.add((r.problem.arch, r.problem.dtype))
                    work = default_set(r.problem.arch, r.problem.dtype, r.problem.device_name).work
                    todo += [(f"default set sm{r.problem.arch} {r.problem.dtype}, problem {i + 1} of {len(work)}",
                              problem, choices) for i, (problem, choices) in enumerate(work)]
            continue
        if not todo:
            break
        stage, problem, choices = todo.pop(0)
        _build(state, stage, [(problem, choices)], jobs)
    for path in handled:
        with contextlib.suppress(OSError):
            path.unlink()
    state.update(stage="done", done=0, total=0, finished=True)
    return set(handled)


def _build(state: _State, stage: str, work: list[tuple[GemmProblem, list[Choice]]], jobs: int) -> None:
    backend = get_backend("cutlass")
    state.update(stage=stage, done=0, total=0)
    try:
        compiled = backend.prebuild(work, jobs, lambda done, total: state.update(done=done, total=total),
                                    retry_failed=False)
    except Exception as e:  # noqa: BLE001 - a batch that cannot run (ninja gone, lock timeout) must not stop the rest
        state.update(stage=f"{stage}: {type(e).__name__}: {e}")
        return
    state.failed_keys |= {backend.artifact_paths(p, c)[0] for p, cs in work for c in cs
                          if backend.state(p, c) == "failed"}
    state.update(compiled=state.compiled + compiled, failed=len(state.failed_keys))


def read_state(w: Where) -> dict | None:
    """state.json when it is one a builder wrote (fields and types checked), else None."""
    data = read_json(w.state)
    if data is None:
        return None
    ints = ("pid", "done", "total", "compiled", "failed")
    if not all(isinstance(data.get(k), int) and not isinstance(data.get(k), bool) for k in ints):
        return None
    if not isinstance(data.get("stage"), str) or not isinstance(data.get("finished"), bool):
        return None
    if not all(isinstance(data.get(k), (int, float)) for k in ("started", "updated")):
        return None
    return data


def describe(w: Where) -> str:
    """Where the background build stands, in a line (`kernels info`)."""
    waiting = len(queued(w))
    state = read_state(w)
    queue = f"; {waiting} request(s) queued" if waiting else ""
    if state is None:
        return f"none has run{queue}"
    if not state["finished"]:
        if builder_running(w) and detached.alive(state["pid"]):
            return (f"running (pid {state['pid']}, low priority): {state['stage']}, {state['done']}/{state['total']} "
                    f"compiled; {state['failed']} failed so far{queue}")
        return (f"interrupted during {state['stage']} (pid {state['pid']} exited); the next tune that lacks CUTLASS "
                f"kernels starts it again{queue}")
    ago = max(0.0, time.time() - state["updated"])
    return (f"finished {ago / 60:.0f} min ago: {state['compiled']} compiled, {state['failed']} failed (not retried; "
            f"`python -m kernels warmup --retry-failed` retries){queue}")


def main(argv: list[str]) -> int:
    detached.exit_on_signals()
    with contextlib.suppress(OSError):
        os.nice(19)         # its compilers inherit it: calls made meanwhile keep the CPU they need
    config.cache_dir = json.loads(argv[1])["cache"]
    run_builder(where())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
