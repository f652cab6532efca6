"""Performance-model data: the dataset CSV (one row per benchmarked candidate, with the GPU and versions it came from),
the built-in shape lists, and `collect()`, which runs the tuner itself (kernels.autotune.tune: same build, verify and
timing code) over a shape list with an exhaustive search space and appends every timing to the dataset.
"""
from __future__ import annotations

import csv
import gzip
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.errors import NoCandidateError
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.core.version import __version__
from kernels.measure.timing import LAUNCH_GAP_MS
from kernels.space.families import one_launch
from kernels.tune.autotune import _package_version, tune

COLUMNS = ("gpu", "arch", "device", "triton", "torch", "kernels", "date", "op", "dtype", "out_dtype", "precision",
           "m", "n", "k", "stride_a", "stride_b", "backend", "template", "name", "choice", "ms", "status", "gpu_ms")
# gpu_ms: GPU time per call with the host taken out (kernels.timing.device_time_ms), written by `model relabel` for
# problems whose calls are short enough for host cost to set `ms`; empty elsewhere (and in files older than it)

# training shapes: square, skinny (decode-like M), large K, odd sizes
TRAIN_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096), (16, 4096, 4096),
                (32, 11008, 4096), (64, 12288, 4096), (128, 4096, 14336), (256, 8192, 4096), (128, 128, 32768),
                (1024, 1024, 16384), (1000, 3000, 2000), (2047, 2047, 2047), (777, 1536, 4096),
                (5120, 1280, 640), (8192, 2048, 1024))
# held out: never used for training; the targets are measured on these (mixed skinny, square, large K, odd)
HELDOUT_SHAPES = ((768, 768, 768), (3072, 3072, 3072), (6144, 6144, 2048), (16, 8192, 8192), (32, 4096, 14336),
                  (48, 12288, 4096), (96, 22016, 4096), (200, 5120, 5120), (512, 4096, 11008), (2048, 512, 8192),
                  (64, 64, 65536), (256, 256, 16384), (4096, 128, 4096), (1500, 1500, 1500), (3000, 2000, 1000),
                  (1234, 4321, 2345), (8192, 1024, 1024), (1024, 8192, 512), (24, 6144, 1536), (4000, 4000, 320),
                  (640, 2560, 10240), (8192, 8192, 1024))
TINY_SHAPES = ((16, 16, 16), (17, 33, 65), (32, 64, 48))      # CPU / interpreter smoke runs
SHAPE_LISTS = {"train": TRAIN_SHAPES, "heldout": HELDOUT_SHAPES, "tiny": TINY_SHAPES}


def parse_shapes(text: str) -> list[tuple[int, int, int]]:
    """'train', 'heldout', 'tiny', 'MxNxK,MxNxK,...', or a file with one 'M,N,K' (or MxNxK) per line."""
    if text in SHAPE_LISTS:
        return list(SHAPE_LISTS[text])
    if os.path.exists(text):
        items = [ln.split("#")[0].replace(",", "x") for ln in Path(text).read_text().splitlines()]
    else:
        items = text.split(",")
    shapes = []
    for i, item in enumerate(items, 1):
        item = item.replace(" ", "").lower()
        if not item or item.startswith("m"):       # blank line or a header
            continue
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"shapes {text!r} item {i}: expected MxNxK (or M,N,K in a file), got {item!r}")
        shapes.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return shapes


@dataclass(frozen=True)
class Row:
    problem: GemmProblem
    choice: Choice
    ms: float | None            # None: failed (status says why)
    status: str
    gpu: str
    triton: str
    date: str
    gpu_ms: float | None = None


def selection_rows(sel, env: dict) -> list[dict]:
    """Dataset rows (dicts of COLUMNS) for every candidate a Selection timed or saw fail (one timed and never verified
    keeps its NOT_VERIFIED text as its status, no label: a wrong kernel can be fast; `collect` verifies all). Each
    timed candidate is
    labelled with its first-pass time: the final round's candidates hold their final-round time in `timings` (for
    calls of 0.1 ms or more, 1 s windows with the chip at its power cap, up to ~12% slower than a first pass), and a
    dataset mixing the two regimes would rank those few below the others; the model ranks for the first pass."""
    p = sel.problem
    rows = []
    first_pass = sel.first_pass()
    for name, t in sel.timings.items():
        choice = sel.choices.get(name)
        if choice is None:
            continue
        first = first_pass.get(name) if isinstance(t, float) else None
        t = first if first is not None and first > 0 else t
        ok = isinstance(t, float)
        rows.append(dict(env, gpu=p.device_name, arch=p.arch, device=p.device, op=p.op, dtype=p.dtype,
                         out_dtype=p.out_dtype, precision=p.precision, m=p.m, n=p.n, k=p.k,
                         stride_a=f"{p.stride_a[0]}:{p.stride_a[1]}", stride_b=f"{p.stride_b[0]}:{p.stride_b[1]}",
                         backend=choice.backend, template=choice.template, name=name,
                         choice=json.dumps(choice.as_dict(), separators=(",", ":")),
                         ms=f"{t:.6g}" if ok else "", status="ok" if ok else str(t)[:200].replace("\n", " ")))
    return rows


def append_rows(path: str | os.PathLike, rows: Iterable[dict]) -> None:
    """Append to a dataset CSV, in the columns of its header when it has one (a file written before a column was
    added stays readable: the new column is left out of it)."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = COLUMNS
    if not new:
        with open(path, newline="") as f:
            columns = tuple(next(csv.reader(f), COLUMNS))
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({c: row.get(c, "") for c in columns})
        f.flush()
        os.fsync(f.fileno())


def read_dataset(paths: Iterable[str | os.PathLike]) -> tuple[list[Row], list[str]]:
    """Rows of one or more dataset files (plain or gzip-compressed CSV: `.gz`), and a line per row that could not be
    read (skipped)."""
    rows, bad = [], []
    for path in paths:
        with (gzip.open(path, "rt", newline="") if str(path).endswith(".gz") else open(path, newline="")) as f:
            for i, rec in enumerate(csv.DictReader(f), 2):
                try:
                    sa = tuple(int(x) for x in rec["stride_a"].split(":"))
                    sb = tuple(int(x) for x in rec["stride_b"].split(":"))
                    problem = GemmProblem(op=rec["op"], m=int(rec["m"]), n=int(rec["n"]), k=int(rec["k"]),
                                          dtype=rec["dtype"], out_dtype=rec["out_dtype"], stride_a=sa, stride_b=sb,
                                          align_a=16, align_b=16, device=rec["device"], arch=int(rec["arch"]),
                                          device_name=rec["gpu"], precision=rec["precision"])
                    choice = Choice.from_dict(json.loads(rec["choice"]))
                    ms = float(rec["ms"]) if rec["status"] == "ok" else None
                    gpu_ms = float(rec["gpu_ms"]) if rec.get("gpu_ms") and ms is not None else None
                    rows.append(Row(problem, choice, ms, rec["status"], rec["gpu"], rec["triton"], rec["date"],
                                    gpu_ms))
                except (KeyError, ValueError, TypeError, AttributeError) as e:
                    bad.append(f"{path}:{i}: {type(e).__name__}: {e}")
    return rows, bad


def problem_of(row: Row) -> tuple:
    """What makes two rows the same problem: op, dtype, M, N, K and the operand strides."""
    p = row.problem
    return (p.op, p.dtype, p.out_dtype, p.m, p.n, p.k, p.stride_a, p.stride_b)


def gpu_labelled(rows: list[Row], keep_unlabelled: bool) -> list[Row]:
    """Rows with `ms` set to what a model should rank by. In problems with GPU times (`model relabel`): a one-launch
    candidate's GPU time plus LAUNCH_GAP_MS -- its call time when the GPU is the bottleneck; the host-set call times
    measured are noise there -- and the others' call times (their extra launches cost host time a GPU time leaves
    out: int8 768^3's kmajor tiles ran 15 us per call beside 9.9 us for one-launch ones). One row per candidate (its
    fastest). Other problems' rows as they are. A relabelled problem's one-launch candidates without a GPU time are
    dropped, or, with `keep_unlabelled`, kept at their call time, about an upper bound (for scoring picks, never for
    training)."""

    labelled = {problem_of(r) for r in rows if r.gpu_ms is not None}
    best: dict[tuple, tuple[tuple, Row]] = {}
    out: list[Row] = []
    for r in rows:
        key = problem_of(r)
        if key not in labelled:
            out.append(r)
            continue
        by_gpu = one_launch(r.choice)
        if by_gpu and r.gpu_ms is not None:
            cand, rank = replace(r, ms=r.gpu_ms + LAUNCH_GAP_MS), 0
        elif by_gpu and not keep_unlabelled:
            continue
        else:
            cand, rank = r, 0 if not by_gpu else 1
        order = (rank, cand.ms if cand.ms is not None else math.inf)
        name = (key, r.choice.name)
        # a GPU label beats a call time for one-launch candidates; among like ones the fastest counts
        if name not in best or order < best[name][0]:
            best[name] = (order, cand)
    return out + [cand for _, cand in best.values()]


def run_env() -> dict:
    """The versions and date a dataset row records beside its timing."""

    return {"triton": _package_version("triton"), "torch": torch.__version__, "kernels": __version__,
            "date": time.strftime("%Y-%m-%d", time.gmtime())}


def problems_in(path: Path, key: Callable[[Row], tuple]) -> set[tuple]:
    """`key` of every row of the dataset file at `path` (none when it does not exist yet): what a resumed run
    skips."""
    if not path.exists():
        return set()
    rows, _ = read_dataset([path])
    return {key(r) for r in rows}


def collect(shapes: list[tuple[int, int, int]], dtypes: list[str], out: str | os.PathLike, *,
            backends: tuple[str, ...] = ("aten", "triton"), max_configs: int | None = 48, bench_ms: float = 10.0,
            time_limit_s: float | None = None, resume: bool = False, explore: bool = False,
            progress: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> int:
    """Tune every (dtype, shape) with the exhaustive search space and the benchmark space `sample:max_configs`
    (`explore:max_configs` with `explore`: the model's favourites among them; `all` when max_configs is None),
    appending every candidate's timing to `out` after each problem (so an interrupted run keeps what it measured;
    `resume` skips problems already in the file). Returns rows written."""

    out = Path(out)
    if not resume and out.exists():
        out.unlink()
    done = problems_in(out, lambda r: (r.problem.dtype, r.problem.m, r.problem.n, r.problem.k)) if resume else set()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        progress("no CUDA GPU: tuning on CPU through the Triton interpreter; these times are NOT GPU data")
    saved = dict(config._overrides)
    config.search_space = "exhaustive"
    config.benchmark_space = f"{'explore' if explore else 'sample'}:{max_configs}" if max_configs else "all"
    config.bench_budget_ms = bench_ms
    config.backends = backends
    config.lut = ""
    env = run_env()
    todo = [(d, s) for d in dtypes for s in shapes if (d, *s) not in done]
    start = time.perf_counter()
    written = 0
    try:
        for i, (dtype, (m, n, k)) in enumerate(todo, 1):
            elapsed = time.perf_counter() - start
            if time_limit_s is not None and elapsed > time_limit_s:
                progress(f"time limit {time_limit_s:.0f} s reached after {i - 1} of {len(todo)} problems; "
                         "rerun with --resume to continue")
                break
            op = "int_mm" if dtype == "int8" else "mm"
            if dtype == "int8":
                a = torch.randint(-128, 128, (m, k), dtype=torch.int8, device=device)
                b = torch.randint(-128, 128, (k, n), dtype=torch.int8, device=device)
            else:
                a = torch.randn(m, k, device=device).to(DTYPES_BY_NAME[dtype])
                b = torch.randn(k, n, device=device).to(DTYPES_BY_NAME[dtype])
            problem = GemmProblem.from_tensors(op, a, b)
            del a, b
            t0 = time.perf_counter()
            try:
                sel, _ = tune(problem, backends, verify_all=True)
            except NoCandidateError as e:
                progress(f"[{i}/{len(todo)}] {dtype} {m}x{n}x{k}: no candidate passed ({len(e.failures)} failures)")
                continue
            except Exception as e:  # noqa: BLE001 - one bad problem must not end a long collection
                progress(f"[{i}/{len(todo)}] {dtype} {m}x{n}x{k}: error {type(e).__name__}: {str(e)[:200]}")
                continue
            finally:
                if device == "cuda":
                    torch.cuda.empty_cache()
            rows = selection_rows(sel, env)
            append_rows(out, rows)
            written += len(rows)
            timed = sum(r["status"] == "ok" for r in rows)
            aten = next((t for nm, t in sel.timings.items() if nm.startswith("aten") and isinstance(t, float)), None)
            best = sel.ranked()[0] if sel.ranked() else ("-", float("nan"))
            elapsed = time.perf_counter() - start
            eta = elapsed / i * (len(todo) - i)
            progress(f"[{i}/{len(todo)}] {dtype} {m}x{n}x{k}: {timed} timed, {len(rows) - timed} failed in "
                     f"{time.perf_counter() - t0:.1f} s; best {best[0]} {best[1] * 1e3:.1f} us"
                     f"{f' (aten {aten * 1e3:.1f} us)' if aten else ''}; elapsed {elapsed:.0f} s, eta {eta:.0f} s")
    finally:
        config._overrides.clear()
        config._overrides.update(saved)
    return written
