"""`python -m kernels ...`:

    info                          what this machine offers the tuner, and why a backend would be left out
    fastpath build [--force]      compile the C++ warm-call table for this torch/Python (retries a failed build)
    lut export [-o FILE]          a lookup table from the selection store (top-k per problem)
    lut check FILE                validate a lookup table and report what is used and what is skipped
    model collect                 (GPU) tune a shape list exhaustively and write a dataset CSV
    model train --data CSV...     fit the learned performance model on CPU (reproducible)
    model eval --data CSV...      Spearman and top-k regret of the analytic and learned models
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import sys
from importlib import metadata


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _probe_problem(arch: int, name: str):
    """A plain aligned bf16 problem on the first device: what `available()` is asked about."""
    from kernels.problem import GemmProblem

    device = "cuda" if arch else "cpu"
    return GemmProblem(op="mm", m=1024, n=1024, k=1024, dtype="bf16", out_dtype="bf16", stride_a=(1024, 1),
                       stride_b=(1024, 1), align_a=16, align_b=16, device=device, arch=arch, device_name=name)


def _fastpath_line(mode: str) -> str:
    from kernels import fastpath

    where = fastpath.paths()
    if where.library.exists():
        return f"built ({where.library}); KERNELS_FASTPATH={mode}"
    if where.failed.exists():
        return f"build failed (log: {where.log}); `python -m kernels fastpath build --force` retries"
    return f"not built; KERNELS_FASTPATH={mode} ('auto' builds it in the background on the first tune)"


def info_lines() -> list[str]:
    import torch

    from backends import get_backend
    from kernels.config import ALL_BACKENDS, config
    from kernels.toolchain import toolchain

    lines = []
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        arch, name = cap[0] * 10 + cap[1], torch.cuda.get_device_name(0)
        lines.append(f"gpu:       {name} (compute capability {cap[0]}.{cap[1]}, {torch.cuda.device_count()} device(s))")
    else:
        arch, name = 0, "cpu"
        lines.append("gpu:       none (torch.cuda.is_available() is False)")
    lines.append(f"torch:     {torch.__version__} (CUDA {torch.version.cuda or '-'})")
    lines.append(f"triton:    {_version('triton')}")
    tools = toolchain()
    lines.append(f"nvcc:      {tools.nvcc} ({tools.nvcc_version})" if tools.nvcc else "nvcc:      not found")
    if tools.cutlass:
        lines.append(f"cutlass:   {tools.cutlass.root} (version {tools.cutlass.version}, from {tools.cutlass.source})")
    else:
        lines.append("cutlass:   not found")
    for line in tools.tried:
        lines.append(f"           tried {line}")
    lines.append(f"cache dir: {config.cache_dir}")
    lines.append(f"fastpath:  {_fastpath_line(config.fastpath)}")
    lines.append(f"backends:  configured {','.join(config.backends)}")
    problem = _probe_problem(arch, name)
    for backend_name in ALL_BACKENDS:
        try:
            status = _backend_status(get_backend(backend_name), problem)
        except Exception as e:  # noqa: BLE001 - a backend that cannot even load is reported, not fatal
            status = f"unavailable: {type(e).__name__}: {e}"
        lines.append(f"  {backend_name:8s} {status}")
    return lines


# the unaligned probe padded is asked about: bf16 rows of K=1001 elements start 2 bytes off a 16-byte boundary
PADDED_PROBE_K = 1001


def _backend_status(backend, problem) -> str:
    """Whether the backend serves problems on this machine, in words true here. `problem` is a made-up aligned bf16
    product on the first device, so each backend is asked about the problems it exists for."""
    import dataclasses

    from kernels.config import interpret_mode

    if backend.name == "padded":
        # padded exists for unaligned operands: asked about the aligned probe it would only say it is not needed
        unaligned = dataclasses.replace(problem, k=PADDED_PROBE_K, stride_a=(PADDED_PROBE_K, 1))
        ok, why = backend.available(unaligned)
        what = ("pads operands whose rows are not 16-byte aligned (e.g. bf16 K=1001) and runs aten or Triton on "
                "the aligned copies; aligned problems skip it")
        return f"available: {what}" if ok else f"unavailable: {why}"
    gpu = problem.device == "cuda"
    if backend.name == "cutlass" and not gpu:
        # no GPU to run on, but what a GPU would run can still be built (bench.compare --backends cutlass does)
        target = dataclasses.replace(problem, device="cuda", arch=90, device_name="sm90 (compile-only)")
        ok, why = backend.available(target)
        return ("no GPU: compile-only (nvcc and CUTLASS headers found; builds for sm90, runs nothing)" if ok
                else f"unavailable: no GPU, and cannot compile for one either: {why}")
    ok, why = backend.available(problem)
    if backend.name == "triton" and not gpu:
        return ("available through the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors, slowly; not bf16, "
                "whose dot the interpreter gets wrong (triton issue #11584)" if ok else "no GPU: Triton runs only through its interpreter on CPU tensors, which "
                "TRITON_INTERPRET=1 turns on before triton is imported (bench.compare sets it)")
    return "available" if ok else f"unavailable: {why}"


def _lut_export(args) -> int:
    from pathlib import Path

    from kernels import lut
    from kernels.config import config

    root = Path(args.store) if args.store else Path(config.cache_dir) / "selections"
    table = lut.export_from_store(root, args.top_k, args.mode)
    if args.output == "-":
        sys.stdout.write(lut.dumps(table))
    else:
        lut.save(table, args.output)
    print(f"{len(table.entries)} entries (top {args.top_k} per problem) from {root} -> {args.output}",
          file=sys.stderr)
    return 0


def _lut_check(args) -> int:
    import warnings
    from collections import Counter

    from kernels import lut

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = lut.load(args.file)
    problems = [str(w.message) for w in caught if issubclass(w.category, lut.LutWarning)]
    for line in problems:
        print(f"warning: {line}")
    modes = Counter(e.mode for e in table.entries)
    ops = Counter(f"{e.op}/{e.dtype}" for e in table.entries)
    gpus = Counter(e.gpu for e in table.entries)
    print(f"{args.file}: schema version {table.version}, {len(table.entries)} usable entries "
          f"({', '.join(f'{k} {v}' for k, v in sorted(modes.items())) or 'none'}), "
          f"{sum(len(e.choices) for e in table.entries)} choices; "
          f"ops {dict(sorted(ops.items()))}; gpus {dict(sorted(gpus.items()))}; {len(problems)} warning(s)")
    return 1 if problems else 0


def _model_collect(args) -> int:
    from kernels.perf_data import collect, parse_shapes

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
    from kernels.perf_relabel import relabel

    n = relabel(args.data, args.out, below_ms=args.below_us / 1e3, top=args.top or None,
                time_limit_s=args.time_limit)
    print(f"wrote {n} rows to {args.out}", file=sys.stderr)
    return 0


def _load_rows(paths, gpu: str | None, for_training: bool = False):
    """This GPU's rows of the dataset files, each problem's labels as kernels.perf_data.gpu_labelled gives them."""
    from collections import Counter

    from kernels.perf_data import gpu_labelled, read_dataset

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
    from kernels.perf_eval import score
    from kernels.perf_model import AnalyticModel

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
    import hashlib
    import re
    import time
    from pathlib import Path

    from kernels import perf_learned
    from kernels.perf_eval import problem_key

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
    out = args.out or str(Path(__file__).parent / "data" /
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
    from kernels.perf_eval import cv_fold, geomean, problem_key

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
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool.map


def _model_eval(args) -> int:
    from kernels import perf_learned

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


def _fastpath_build(args) -> int:
    from kernels import fastpath

    try:
        library = fastpath.build(force=args.force)
    except fastpath.FastpathBuildError as e:
        print(f"fastpath build failed: {e}", file=sys.stderr)
        if e.log:
            print(e.log[-4000:], file=sys.stderr)
        return 1
    print(library)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kernels", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the toolchain and backends")

    fp = sub.add_parser("fastpath", help="the C++ warm-call table").add_subparsers(dest="fastpath_command",
                                                                                  required=True)
    fpb = fp.add_parser("build", help="compile it now (normally built in the background on the first tune)")
    fpb.add_argument("--force", action="store_true", help="retry even when an earlier build failed")

    lut = sub.add_parser("lut", help="lookup tables").add_subparsers(dest="lut_command", required=True)
    exp = lut.add_parser("export", help="write a lookup table from the selection store")
    exp.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    exp.add_argument("--store", help="selection store directory (default: <cache dir>/selections)")
    exp.add_argument("--top-k", type=int, default=3, help="fastest choices kept per problem (default 3)")
    exp.add_argument("--mode", choices=("add", "only"), default="add")
    chk = lut.add_parser("check", help="validate a lookup table")
    chk.add_argument("file")

    model = sub.add_parser("model", help="performance model").add_subparsers(dest="model_command", required=True)
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
            p.add_argument("--seed", type=int, default=0)
            p.add_argument("--steps", type=int, default=1500)
            p.add_argument("--hidden", type=int, default=48)
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
    if args.command == "info":
        print("\n".join(info_lines()))
        return 0
    if args.command == "fastpath":
        return _fastpath_build(args)
    if args.command == "lut":
        return _lut_export(args) if args.lut_command == "export" else _lut_check(args)
    return {"collect": _model_collect, "relabel": _model_relabel, "train": _model_train, "eval": _model_eval,
            "cv": _model_cv}[args.model_command](args)


if __name__ == "__main__":
    sys.exit(main())
