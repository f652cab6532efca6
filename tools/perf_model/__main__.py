"""`python -m tools.perf_model ...`: the performance model's data and training (offline; not imported by kernels).

    collect                       (GPU) tune a shape list exhaustively and write a dataset CSV
    relabel                       (GPU) GPU time of every candidate of a dataset's short problems
    train --data CSV...           fit the learned performance model on CPU (reproducible)
    eval --data CSV...            Spearman and top-k regret of the analytic and learned models
    cv --data CSV...              leave-one-problem-out cross-validation

The datasets are tools/perf_model/data/*.csv(.gz) (see data/README.md); the shipped models are
kernels/data/perf_model_*.json.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import multiprocessing
import re
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kernels.space import perf_learned
from kernels.space.perf_model import AnalyticModel
from tools.perf_model.data import collect, gpu_labelled, parse_shapes, read_dataset
from tools.perf_model.evaluate import cv_fold, geomean, problem_key, score
from tools.perf_model.relabel import relabel

MODELS_DIR = Path(perf_learned.__file__).resolve().parents[1] / "data"


def _model_collect(args) -> int:
    shapes = parse_shapes(args.shapes)
    if args.limit_shapes:
        shapes = shapes[:args.limit_shapes]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    n = collect(shapes, dtypes, args.out, backends=backends, max_configs=args.max_configs or None,
                bench_ms=args.bench_ms, time_limit_s=args.time_limit, resume=args.resume, explore=args.explore)
    print(f"wrote {n} rows to {args.out}", file=sys.stderr)
    return 0 if n else 1


def _model_relabel(args) -> int:
    n = relabel(args.data, args.out, below_ms=args.below_us / 1e3, top=args.top or None,
                time_limit_s=args.time_limit)
    print(f"wrote {n} rows to {args.out}", file=sys.stderr)
    return 0


def _load_rows(paths, gpu: str | None, for_training: bool = False):
    """This GPU's rows of the dataset files, each problem's labels as tools.perf_model.data.gpu_labelled gives them."""
    rows, bad = read_dataset(paths)
    for line in bad[:10]:
        print(f"skipped row {line}", file=sys.stderr)
    gpus = Counter(r.gpu for r in rows if r.ms is not None)
    if gpu is None and len(gpus) > 1:
        raise SystemExit(f"the data comes from several GPUs {dict(gpus)}: choose one with --gpu")
    gpu = gpu or (next(iter(gpus)) if gpus else "")
    # labelled after the GPU filter: gpu_labelled keeps one row per problem and candidate, whatever GPU timed it
    return gpu_labelled([r for r in rows if r.gpu == gpu], keep_unlabelled=not for_training), gpu


def _report(rows, top_k: int, learned, title: str) -> None:

    print(f"{title}:")
    models = [AnalyticModel()] + ([learned] if learned is not None else [])
    for model in models:
        s = score(model, rows, top_k)
        print("  " + s.summary())
        if len(models) == 1 or model is learned:
            for p in s.problems:
                tuned = "" if p.regret_tuned is None else f" with aten {p.regret_tuned:.3f}"
                print(f"    {p.label:<48} n={p.candidates:<5} rho={p.spearman:6.3f} regret={p.regret:.3f}{tuned} "
                      f"picked {p.picked}")


def _model_train(args) -> int:
    rows, gpu = _load_rows(args.data, args.gpu, for_training=True)
    held: set = set()
    if args.holdout_frac > 0:
        keys = sorted({problem_key(r) for r in rows}, key=lambda t: hashlib.sha256(repr(t).encode()).hexdigest())
        held = set(keys[:max(1, int(len(keys) * args.holdout_frac))])
    train = [r for r in rows if problem_key(r) not in held]
    timed = [(r.problem, r.choice, r.ms) for r in train if r.ms is not None and r.choice.backend != "aten"]
    digest = hashlib.sha256(b"".join(Path(p).read_bytes() for p in args.data)).hexdigest()[:16]
    meta = perf_learned.default_meta(gpu, ",".join(Path(p).name for p in args.data), digest,
                                     arch=rows[0].problem.arch if rows else 0)
    triton_versions = sorted({r.triton for r in rows})
    if triton_versions:
        meta["triton"] = triton_versions[-1]      # the data's Triton, not this machine's
    meta["data_dates"] = sorted({r.date for r in rows})
    if args.note:
        meta["note"] = args.note
    start = time.perf_counter()
    params = perf_learned.fit(timed, meta, seed=args.seed, steps=args.steps, hidden=args.hidden,
                              members=args.members)
    out = args.out or str(MODELS_DIR /
                          f"perf_model_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_') or 'unknown'}.json")
    perf_learned.save(params, out)
    print(f"fitted on {params['meta']['rows']} timed candidates from {gpu} in {time.perf_counter() - start:.1f} s "
          f"(train RMSE of log time {params['meta']['train_rmse_log']:.3f}) -> {out}")
    model = perf_learned.LearnedModel(params, out)
    if held:
        _report([r for r in rows if problem_key(r) in held], args.top_k, model, f"held-out problems ({len(held)})")
    if args.eval:
        eval_rows, _ = _load_rows(args.eval, gpu)
        _report(eval_rows, args.top_k, model, f"evaluation data {', '.join(args.eval)}")
    return 0


def _model_cv(args) -> int:
    """Leave-one-problem-out: fit on every other problem, score the left-out one; for several analytic shares and
    ensemble picks. Folds run in parallel processes (--jobs); each fit is the single-threaded, seeded one."""

    rows, gpu = _load_rows(args.data, args.gpu, for_training=True)
    dtypes = {d.strip() for d in args.dtypes.split(",")} if args.dtypes else None
    problems = sorted({problem_key(r) for r in rows if dtypes is None or r.problem.dtype in dtypes})
    shares = [float(x) for x in args.shares.split(",")]
    ensembles = [e.strip() for e in args.ensembles.split(",")]
    fit_args = dict(seed=args.seed, steps=args.steps, hidden=args.hidden, members=args.members)
    regrets: dict[str, list[float]] = {}
    jobs = [(rows, gpu, left_out, fit_args, args.top_k, shares, ensembles) for left_out in problems]
    with _parallel_map(args.jobs) as pmap:
        for left_out, fold in zip(problems, pmap(cv_fold, jobs)):
            for name, regret in fold:
                regrets.setdefault(name, []).append(regret)
            print(f"{left_out[1]} {'x'.join(map(str, left_out[2:]))} " + " ".join(f"{n}={r:.3f}" for n, r in fold),
                  flush=True)
    print(f"leave-one-problem-out over {len(problems)} problems, top-{args.top_k} regret (geomean / worst):")
    for name, vals in regrets.items():
        print(f"  {name:>20}: {geomean(vals):.3f} / {max(vals):.3f}")
    return 0


@contextlib.contextmanager
def _parallel_map(jobs: int):
    """`map` over `jobs` spawned processes (a fork of a process whose torch thread pool is up can hang), or the
    builtin map for one job."""
    if jobs <= 1:
        yield map
        return

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool.map


def _model_eval(args) -> int:
    rows, gpu = _load_rows(args.data, args.gpu)
    if args.dtypes:
        rows = [r for r in rows if r.problem.dtype in {d.strip() for d in args.dtypes.split(",")}]
    learned = None
    if args.model:
        learned, why = perf_learned.load(args.model)
        if learned is None:
            print(f"cannot load {args.model}: {why}", file=sys.stderr)
            return 2
    _report(rows, args.top_k, learned, f"{gpu}: {', '.join(args.data)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.perf_model", description=__doc__.split("\n\n")[0])
    model = parser.add_subparsers(dest="model_command", required=True)
    col = model.add_parser("collect", help="(GPU) exhaustive tuning over a shape list -> dataset CSV")
    col.add_argument("--shapes", default="train", help="train, heldout, tiny, MxNxK,MxNxK or a file (default train)")
    col.add_argument("--dtypes", default="bf16,int8", help="comma list (default bf16,int8)")
    col.add_argument("--backends", default="aten,triton", help="default aten,triton (aten rows are a reference)")
    col.add_argument("--max-configs", type=int, default=48,
                     help="per problem: the default list plus this many sampled from the exhaustive space "
                          "(0 = all; default 48)")
    col.add_argument("--explore", action="store_true",
                     help="half of --max-configs from the performance model's top picks, the rest drawn per problem "
                          "(default: drawn by name, the same names on every shape)")
    col.add_argument("--limit-shapes", type=int, default=0, help="only the first N shapes of the list")
    col.add_argument("--bench-ms", type=float, default=10.0, help="measurement budget per candidate (default 10)")
    col.add_argument("--time-limit", type=float, default=None, help="start no new problem after this many seconds")
    col.add_argument("--resume", action="store_true", help="append to --out, skipping problems already there")
    col.add_argument("--out", required=True, help="dataset CSV to write")
    rel = model.add_parser("relabel", help="(GPU) GPU time of every candidate of a dataset's short problems")
    rel.add_argument("--data", nargs="+", required=True, help="dataset CSV file(s) collected on this GPU")
    rel.add_argument("--out", required=True, help="dataset CSV to append to (problems already there are skipped)")
    rel.add_argument("--below-us", type=float, default=25.0,
                     help="relabel problems whose fastest call is under this many us (default 25)")
    rel.add_argument("--top", type=int, default=0, help="only the N fastest candidates per problem (default all)")
    rel.add_argument("--time-limit", type=float, default=None, help="start no new problem after this many seconds")
    for name, helptext in (("train", "fit the learned model"), ("eval", "score the models on a dataset"),
                           ("cv", "leave-one-problem-out cross-validation of the learned model and the top-k blend")):
        p = model.add_parser(name, help=helptext)
        p.add_argument("--data", nargs="+", required=True, help="dataset CSV file(s)")
        p.add_argument("--gpu", help="use only rows from this GPU (needed when the data mixes GPUs)")
        p.add_argument("--top-k", type=int, default=5, help="benchmark space scored (default 5)")
        if name in ("train", "cv"):
            p.add_argument("--seed", type=int, default=0, help="first member's seed (default 0): fits are reproducible")
            p.add_argument("--steps", type=int, default=1500, help="optimiser steps per member (default 1500)")
            p.add_argument("--hidden", type=int, default=48, help="hidden units of each MLP layer (default 48)")
            p.add_argument("--members", type=int, default=5, help="MLPs averaged (seeds seed..seed+members-1)")
        if name == "cv":
            p.add_argument("--shares", default="0,0.2,0.4,0.6",
                           help="analytic shares of the top k to compare (default 0,0.2,0.4,0.6)")
            p.add_argument("--ensembles", default="mean,optimistic",
                           help="how the ensemble ranks, to compare (default mean,optimistic)")
            p.add_argument("--dtypes", help="leave out only problems of these dtypes (comma list; all still train)")
            p.add_argument("--jobs", type=int, default=1, help="folds fitted in parallel processes (default 1)")
        elif name == "train":
            p.add_argument("--out", help="parameter file (default kernels/data/perf_model_<gpu>.json)")
            p.add_argument("--eval", nargs="+", help="held-out dataset CSV(s) to report on")
            p.add_argument("--holdout-frac", type=float, default=0.0,
                           help="hold out this fraction of the problems (by a stable hash) and report on them")
            p.add_argument("--note", help="free text stored in the model's meta")
        else:
            p.add_argument("--model", help="learned model parameters (.json); without it only the analytic model")
            p.add_argument("--dtypes", help="score only problems of these dtypes (comma list)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"collect": _model_collect, "relabel": _model_relabel, "train": _model_train, "eval": _model_eval,
            "cv": _model_cv}[args.model_command](args)


if __name__ == "__main__":
    sys.exit(main())
