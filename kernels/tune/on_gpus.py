"""`python -m kernels tune --gpus`: the offline run (kernels.tune.offline) spread over several GPUs of one host.

What the store has is skipped and the CUTLASS candidates are compiled here, in one batch on every core while the workers
start (as the one-GPU run does: a binary is built once for the host); then gpu_pool hands the rest, largest first,
to one worker per device (`python -m kernels.dispatch.tune_worker`, started by kernels.tune.worker_launch, usually
by the CLI before it imported torch), each replaying its problems exactly as the one-GPU run does and writing its
selections through the same locked store. The report is offline's, with a line per device.
"""
from __future__ import annotations

import sys

from kernels.core import progress
from kernels.core.selection import Selection
from kernels.tune import gpu_pool, offline
from kernels.tune.problem_list import Listed, line_of
from kernels.tune.worker_launch import EarlyWorkers, Launcher


def run(items: list[Listed], devices: list[int], stored, time_limit: float | None = None, log=None,
        argv: list[str] | None = None, early: EarlyWorkers | None = None) -> offline.Report:
    """Tune the listed problems (already retargeted to these devices' model) the store lacks on `devices`.
    `argv` starts a worker (tests start fake ones); `early` holds workers the CLI started before it imported torch:
    adopted when they are for these devices, else ended (also when nothing is left to tune)."""
    log = log or sys.stderr

    def spread(report: offline.Report, todo: list[Listed], start: float) -> None:
        deadline = None if time_limit is None else start + time_limit
        _spread(report, todo, devices, deadline, f"--time-limit {time_limit or 0:g} s reached", log, argv, early)

    try:
        return offline.run_with(items, stored, spread, time_limit)
    finally:
        if early is not None:
            early.close()


def _spread(report: offline.Report, todo: list[Listed], devices: list[int], deadline: float | None,
            deadline_reason: str, log, argv: list[str] | None, early: EarlyWorkers | None) -> None:
    started = early.adopt(devices) if early is not None else {}
    try:
        _run_pool(report, todo, devices, deadline, deadline_reason, log, argv, early, started)
    except BaseException:
        gpu_pool.stop_workers(list(started.values()))     # adopted, but the pool may not have got to them
        raise


def _run_pool(report: offline.Report, todo: list[Listed], devices: list[int], deadline: float | None,
              deadline_reason: str, log, argv: list[str] | None, early: EarlyWorkers | None,
              started: dict[int, gpu_pool.Worker]) -> None:
    if early is not None and not started:
        report.notes.append(f"the workers started before torch was loaded were for GPUs {early.devices}, torch "
                            f"numbers {devices}: started again")
    launcher = early.launcher if started else Launcher(devices, argv)

    # the largest products first: their tunes are the longest (a steady final round), and the last ones handed out
    # set how long the run takes, so short ones at the end keep the GPUs evenly busy
    biggest_first = sorted(range(len(todo)), key=lambda i: -_work(todo[i]))
    jobs = {i: {"line": line_of(todo[i]), "where": todo[i].where} for i in biggest_first}
    answered = [0]
    with progress.held_by_caller(), progress.bar(len(todo), f"problems tuned on {len(devices)} GPUs") as advance:
        def on_result(result: gpu_pool.Result) -> None:
            outcome = _outcome(todo[result.index], result)
            report.outcomes.append(outcome)
            answered[0] += 1
            advance(answered[0])
            if not progress.shown():
                gpu = f"GPU {result.device}: " if result.device is not None else ""
                print(f"[{answered[0]}/{len(todo)}] {gpu}{offline.line(outcome)}", file=log, flush=True)

        def on_note(text: str) -> None:
            print(f"kernels tune: {text}", file=log, flush=True)

        pool = gpu_pool.Pool(devices, launcher, on_result, on_note, events=launcher.events)
        # the CUTLASS batch compiles while the workers start; no problem is handed out before it is built
        with gpu_pool.terminations_as_interrupt():
            pool.run(jobs, deadline, deadline_reason, prepare=lambda: offline.prebuild_listed(report, todo, log),
                     started=started)
    report.stopped = pool.stopped
    report.notes.extend(_device_lines(pool))
    report.notes.extend(pool.notes)


def _work(item: Listed) -> float:
    """How long a problem's tune will take, as an order: its multiply-adds; a dynamic problem (a tune per size hint)
    first of all."""
    problem = item.problem
    return float("inf") if problem.dynamic else float(problem.m * problem.n * problem.k)


def _outcome(item: Listed, result: gpu_pool.Result) -> offline.Outcome:
    if result.left:
        return offline.Outcome(item, offline.LEFT, reason=result.left)
    if result.failed:
        return offline.Outcome(item, offline.FAILED, reason=result.failed)
    answer = result.answer or {}
    status = answer.get("status")
    if status not in (offline.TUNED, offline.IN_STORE, offline.FAILED):
        return offline.Outcome(item, offline.FAILED, reason=f"the worker on GPU {result.device} answered "
                                                            f"{str(answer)[:200]}")
    sel = None
    if answer.get("selection") is not None:
        try:
            sel = Selection.from_dict(answer["selection"], source=f"GPU {result.device}")
        except (KeyError, TypeError, ValueError) as e:
            return offline.Outcome(item, offline.FAILED, reason=f"the worker on GPU {result.device} sent a bad "
                                                                f"selection: {type(e).__name__}: {e}")
    seconds = answer.get("seconds")
    return offline.Outcome(item, status, sel, float(seconds) if isinstance(seconds, (int, float)) else 0.0,
                           str(answer.get("reason") or ""))


def _device_lines(pool: gpu_pool.Pool) -> list[str]:
    lines = []
    for device, share in pool.logs.items():
        ready = ", ".join(f"{s:.1f}" for s in share.ready_s) or "-"
        died = f", {len(share.deaths)} worker(s) died ({'; '.join(share.deaths)})" if share.deaths else ""
        lines.append(f"GPU {device}: {share.jobs} problems, {share.busy_s:.1f} s busy, worker start {ready} s{died}")
    return lines


def same_model(devices: list[int], describe) -> tuple[str, int, str]:
    """(device, arch, name) every listed GPU shares; `describe(i)` gives (arch, name) of device i. A host mixing
    models is tuned one model at a time: a selection holds for one model only."""
    seen = {i: describe(i) for i in devices}
    models = sorted({name for _, name in seen.values()})
    if len(models) > 1:
        which = "; ".join(f"{i}: {name}" for i, (_, name) in seen.items())
        raise gpu_pool.GpuListError(f"--gpus lists GPUs of different models ({which}): a selection holds for one "
                                    "model; tune each model's GPUs in their own run")
    arch, name = seen[devices[0]]
    return "cuda", arch, name
