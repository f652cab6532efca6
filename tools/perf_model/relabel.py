"""GPU-time labels for a dataset's short problems (`python -m tools.perf_model relabel`).

A dataset row's `ms` is the time of a user's call. Below ~25 us per call that is set by the host, not the kernel: on
the H100 int8 24x6144x1536's 32x64x128 tiles ran 8.7 us on the GPU and 10.1-15 us per call depending on the run, and
whole training problems measured a flat 9-14 us floor across tiles, so a model trained on those labels learns noise
where the kernels differ. Here every candidate of such a problem is rebuilt (same backends, same templates), verified
and timed with the host taken out (kernels.timing.device_time_ms, what tuning's final round ranks close calls by),
and written back with that `gpu_ms` beside the original `ms`; training and scoring then rank those problems by it
(kernels.perf_data.gpu_labelled).
"""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from backends import get_backend
from kernels.core.selection import Selection
from kernels.measure.timing import HOST_SET_MAX_MS, device_time_ms, user_call
from kernels.measure.verify import make_inputs, reference, timing_sets, verify_launch
from tools.perf_model.data import Row, append_rows, problem_of, problems_in, read_dataset, run_env, selection_rows

# problems whose fastest call (aten aside) is under this are relabelled
DEFAULT_BELOW_MS = HOST_SET_MAX_MS


def plan(rows: list[Row], gpu: str, below_ms: float, top: int | None) -> list[tuple[tuple, list[Row]]]:
    """(problem key, the rows to relabel: one per candidate, its fastest call first) for each problem of `gpu` whose
    fastest timed non-aten call is under `below_ms`, the shortest problems first. `top`: only that many of the
    fastest candidates per problem (aten always)."""
    groups: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        if r.gpu != gpu or r.ms is None:
            continue
        per = groups.setdefault(problem_of(r), {})
        if r.choice.name not in per or r.ms < per[r.choice.name].ms:
            per[r.choice.name] = r
    todo = []
    for key, per in groups.items():
        timed = sorted(per.values(), key=lambda r: (r.ms, r.choice.name))
        ours = [r for r in timed if r.choice.backend != "aten"]
        if not ours or ours[0].ms >= below_ms:
            continue
        todo.append((ours[0].ms, key, ours[:top or None] + [r for r in timed if r.choice.backend == "aten"]))
    return [(key, keep) for _, key, keep in sorted(todo, key=lambda t: (t[0], t[1]))]


def relabel_problem(rows: list[Row], gpu_time: Callable, device: str) -> list[dict]:
    """Dataset rows (dicts) for one problem's candidates: built, verified, GPU-timed. A candidate that does not build,
    verify or capture gets a status saying why and no time (its source file keeps its call time)."""

    problem = rows[0].problem
    by_backend: dict[str, list] = {}
    for r in rows:
        by_backend.setdefault(r.choice.backend, []).append(r.choice)
    outcomes = {}
    for name, choices in by_backend.items():
        try:
            for outcome in get_backend(name).build(problem, choices):
                outcomes[outcome.choice.name] = outcome
        except Exception as e:  # noqa: BLE001 - a broken backend costs its rows' GPU times, not the run
            for c in choices:
                outcomes[c.name] = f"build failed: {type(e).__name__}: {e}"
    operands = make_inputs(problem, device, seed=0)
    ref = reference(problem, *operands)
    sets = timing_sets(problem, device, operands, seed=1)
    status: dict[str, str] = {}
    gpu_ms: dict[str, float] = {}
    for r in rows:
        outcome = outcomes.get(r.choice.name, "not built")
        if isinstance(outcome, str) or outcome.runner is None:
            status[r.choice.name] = outcome if isinstance(outcome, str) else (outcome.error or "build failed")
            continue
        if outcome.runner.isolated:
            status[r.choice.name] = "isolated backend: not relabelled"
            continue
        why = verify_launch(outcome.runner.launch, problem, operands, ref)
        if why is not None:
            status[r.choice.name] = why
            continue
        ms = gpu_time(user_call(outcome.runner.launch, sets), len(sets))
        if ms is None:
            status[r.choice.name] = "GPU time not measurable (capture failed)"
        else:
            gpu_ms[r.choice.name] = ms
    sel = Selection(problem=problem, winner=rows[0].choice.name, choices={r.choice.name: r.choice for r in rows},
                    timings={r.choice.name: r.ms for r in rows}, details={}, source="relabel", tune_seconds=0.0,
                    created=time.time(), notes=[])
    out = []
    for rec in selection_rows(sel, run_env()):
        name = rec["name"]
        if name in gpu_ms:
            rec["gpu_ms"] = f"{gpu_ms[name]:.6g}"
        else:
            rec["status"] = f"no GPU time: {status.get(name, '?')[:160]}".replace("\n", " ")
        out.append(rec)
    return out


def relabel(paths: list[str], out: str, *, below_ms: float = DEFAULT_BELOW_MS, top: int | None = None,
            time_limit_s: float | None = None, gpu_time: Callable | None = None,
            progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> int:
    """Relabel the short problems of the dataset files `paths` (rows of this machine's GPU) into `out`, appending one
    problem at a time (an interrupted run keeps what it measured; problems already in `out` are skipped). Returns
    rows written. `gpu_time(call, n_sets)`: the GPU timer (default kernels.measure.timing.device_time_ms)."""
    if gpu_time is None:
        if not torch.cuda.is_available():
            raise RuntimeError("model relabel measures GPU time: it needs a CUDA GPU")
        gpu_time = device_time_ms
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    rows, bad = read_dataset(paths)
    for line in bad[:5]:
        progress(f"skipped row {line}")
    done = problems_in(Path(out), problem_of)
    todo = [(k, rs) for k, rs in plan(rows, gpu, below_ms, top) if k not in done]
    progress(f"{len(todo)} problems of {gpu} under {below_ms * 1e3:.0f} us to relabel ({len(done)} already in {out})")
    start, written = time.perf_counter(), 0
    for i, (key, group) in enumerate(todo, 1):
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            progress(f"time limit {time_limit_s:.0f} s reached after {i - 1} of {len(todo)} problems; rerun to go on")
            break
        t0 = time.perf_counter()
        try:
            recs = relabel_problem(group, gpu_time, device)
        except Exception as e:  # noqa: BLE001 - one bad problem must not end a long run
            progress(f"[{i}/{len(todo)}] {key}: error {type(e).__name__}: {str(e)[:200]}")
            continue
        finally:
            if device == "cuda":
                torch.cuda.empty_cache()
        append_rows(out, recs)
        written += len(recs)
        timed = [float(r["gpu_ms"]) for r in recs if r.get("gpu_ms")]
        progress(f"[{i}/{len(todo)}] {key[1]} {key[3]}x{key[4]}x{key[5]}: {len(timed)} of {len(recs)} GPU-timed in "
                 f"{time.perf_counter() - t0:.1f} s; best call {min(r.ms for r in group) * 1e3:.1f} us, best GPU "
                 f"{min(timed, default=math.nan) * 1e3:.1f} us")
    return written
