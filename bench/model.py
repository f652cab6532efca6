"""`python -m bench.model`: a llama-shaped decoder layer stack (bench/model_def.py, nothing downloaded) timed forward
and forward+backward as a user runs it: torch eager, torch.compile (default, max-autotune), `kernels.patch`, and
`kernels.patch` under torch.compile; tokens/s, each variant's cold time and its numerical difference from eager
(issue 28, "Measured on the GPU").

    python -m bench.model --json model.jsonl                 # llama-7B's layer, bf16, M = 1..8192, fwd and fwdbwd
                                                             # (on a CPU: a small layer, eager and patch, M = 16, 64)
    python -m bench.model --mode fwdbwd --tokens 4096 --variants eager,compile,patch,patch+compile
    python -m bench.model --tokens 1,16 --mode fwd --cudagraphs     # beside them the CUDA-graph pair
    python -m bench.model --table-from model.jsonl           # the table of a saved run

Per (mode, M): every variant is built on a deep copy of one model (one seed, the same weights) and its first step
timed (compile, tune, capture: its cold time); its output (and, fwdbwd, its weight grads) is compared with eager's.
Then the variants' loops alternate, A B C A B C ..., --rounds times, each running its step back to back for --seconds
(on the GPU the loop of bench.sustained: CUDA events around it, the host never more than a few steps ahead) so clocks
and power settle as in training; a variant's ms per step is the median (or --stat min) over its rounds. fwdbwd's step:
grads set to None, forward, loss = out.float().square().mean(), backward. A variant that fails is recorded with its
error; the run goes on.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels
from bench.cli_common import RunFileError, non_negative, positive, positive_int
from bench.device import environment
from bench.measure import finish_duels
from bench.model_def import MODEL_DTYPES, ModelShapeError, build_model, check_shape, model_input
from bench.model_report import (STATS, VariantResult, attach_eager, print_table, read_run,
                                table_title)
from bench.model_variants import (ALL_VARIANTS, CUDAGRAPH_MAX_TOKENS, CUDAGRAPH_VARIANTS, MODES, VARIANTS, Variant,
                                  applies, build_variant, max_rel_err, weight_grads, worst_grad_err)
from bench.progress import RunProgress
from bench.sustained import Call, LoopRunner, cuda_loop
from kernels.core.config import config


def host_loop(call: Call, n_sets: int, seconds: float) -> Callable[[], float]:
    """The LoopRunner off the GPU: synchronous steps back to back for `seconds` (at least one), host clock."""
    start, count = time.perf_counter(), 0
    while count == 0 or time.perf_counter() - start < seconds:
        call(count % n_sets)
        count += 1
    ms = (time.perf_counter() - start) * 1e3 / count
    return lambda: ms


def runner_for(device: str) -> LoopRunner:
    return cuda_loop if device == "cuda" else host_loop


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stats_delta(before: dict, after: dict) -> dict:
    """kernels.stats() counters that moved between two snapshots (nested dicts of counters too)."""
    out = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict):
            inner = stats_delta(old if isinstance(old, dict) else {}, value)
            if inner:
                out[key] = inner
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            moved = value - (old if isinstance(old, (int, float)) else 0)
            if moved:
                out[key] = moved
    return out


def _add_stats(total: dict, more: dict) -> dict:
    for key, value in more.items():
        total[key] = _add_stats(dict(total.get(key, {})), value) if isinstance(value, dict) else \
            total.get(key, 0) + value
    return total


def _failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()[:400]}"


# -- one (mode, M) group --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LoopPlan:
    """How the variants are looped: --seconds per loop, --rounds alternated, --heat of eager before the first."""
    seconds: float = 1.0
    rounds: int = 2
    heat: float = 1.0
    stat: str = "median"


@dataclass
class Setup:
    """What every group shares: the model all variants copy, its input's size and dtype, the variants, the loops."""
    base: torch.nn.Module
    hidden: int
    dtype: str
    device: str
    variants: list[str]
    plan: LoopPlan
    input_seed: int = 1
    runner: LoopRunner | None = None          # None: bench.sustained's CUDA loop on the GPU, the host loop off it


@dataclass
class _Reference:
    out: torch.Tensor | None = None
    grads: dict | None = None


def _cold_step(variant: Variant, result: VariantResult, ref: _Reference, device: str) -> None:
    """The first step, timed, and its difference from eager's (eager's own first step becomes the reference)."""
    before = kernels.stats()
    _sync(device)
    start = time.perf_counter()
    out = variant.step()
    _sync(device)
    result.cold_s = time.perf_counter() - start
    out = out.detach().clone()          # CUDA-graph variants reuse their output memory on the next step
    if variant.name not in CUDAGRAPH_VARIANTS:      # a captured graph's calls never run a duel (they replay)
        duels = finish_duels(variant.step, device)       # the tunes' duels run on the next steps (KERNELS_DUEL=calls)
        result.duel_s, result.duel_steps = duels.seconds, duels.calls
        if duels.timed_out:
            pending = kernels.stats()["duels_pending"]
            result.message = f"{pending} duel(s) on calls still pending after {duels.seconds:.0f} s"
        out = out if duels.last is None else duels.last.detach().clone()    # the winners' output, against eager's
    result.cold_stats = stats_delta(before, kernels.stats())
    grads = weight_grads(variant.module) if result.mode == "fwdbwd" else None
    if variant.name == "eager":
        ref.out, ref.grads = out, grads
        result.out_err = 0.0
        if grads is not None:
            result.grad_err = 0.0
        return
    if ref.out is not None:
        result.out_err = max_rel_err(out, ref.out)
        if grads is not None and ref.grads is not None:
            result.grad_err, result.grad_err_param = worst_grad_err(grads, ref.grads)


def _loops(ready: dict[str, Variant], results: dict[str, VariantResult], plan: LoopPlan,
           runner: LoopRunner) -> None:
    """The variants' loops alternated for plan.rounds rounds; a variant whose step raises is dropped as an error."""
    readers: dict[str, list] = {name: [] for name in ready}
    failed: dict[str, str] = {}
    for _ in range(plan.rounds):
        for name, variant in ready.items():
            if name in failed:
                continue
            before = kernels.stats()
            try:
                readers[name].append(runner(lambda i, step=variant.step: step(), 1, plan.seconds))
            except Exception as e:  # noqa: BLE001 - one variant's failure is its record, not the run's end
                failed[name] = _failure(e)
            _add_stats(results[name].loop_stats, stats_delta(before, kernels.stats()))
    for name, rs in readers.items():
        if name in failed:
            continue
        try:
            results[name].rounds_ms = [read() for read in rs]
        except Exception as e:  # noqa: BLE001
            failed[name] = _failure(e)
    for name, why in failed.items():
        results[name].status, results[name].message = "error", f"in the timing loop: {why}"


def measure_group(setup: Setup, mode: str, tokens: int, progress: RunProgress,
                  out_of_time: Callable[[], bool] = lambda: False) -> list[VariantResult]:
    """Every variant of the setup that applies at (mode, tokens): its cold step, then the loops alternated."""
    device, plan = setup.device, setup.plan
    runner = setup.runner or runner_for(device)
    names = [n for n in setup.variants if applies(n, mode, tokens)]
    results = {n: VariantResult(n, mode, tokens, "ok", stat=plan.stat) for n in names}
    x = model_input(tokens, setup.hidden, setup.dtype, device, setup.input_seed)
    torch._dynamo.reset()          # each group compiles afresh: its cold time, and static shapes as a user's first M
    ref, ready = _Reference(), {}
    for name in names:
        result = results[name]
        if out_of_time():
            result.status, result.message = "skipped", "--time-limit reached"
            continue
        progress.step(f"{mode} M={tokens}: {name}, first call")
        try:
            variant = build_variant(name, setup.base, x, mode)
            _cold_step(variant, result, ref, device)
            ready[name] = variant
        except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported, the others still run
            result.status, result.message = "error", _failure(e)
            _sync_quietly(device)
    if ready:
        progress.step(f"{mode} M={tokens}: {len(ready)} variants' loops")
        if plan.heat > 0 and "eager" in ready:
            heat_step = ready["eager"].step
            runner(lambda i: heat_step(), 1, plan.heat)    # unread: the first round starts on a warm chip
        _loops(ready, results, plan, runner)
    out = list(results.values())
    attach_eager(out)
    del ready, ref
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def _sync_quietly(device: str) -> None:
    with contextlib.suppress(Exception):
        _sync(device)


# -- the command ----------------------------------------------------------------------------------------------------
class ArgumentsError(ValueError):
    """A flag's value that cannot run; the message names the flag."""


def parse_tokens(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ArgumentsError("--tokens names no M")
    bad = [t for t in items if not t.isdigit() or int(t) < 1]
    if bad:
        raise ArgumentsError(f"--tokens {text!r}: {bad[0]!r} is not a positive integer (e.g. 1,16,128)")
    return list(dict.fromkeys(int(t) for t in items))


def parse_list(text: str, flag: str, allowed: tuple[str, ...]) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ArgumentsError(f"{flag} names nothing; allowed: {', '.join(allowed)}")
    for item in items:
        if item not in allowed:
            raise ArgumentsError(f"{flag}: unknown {item!r}; allowed: {', '.join(allowed)}")
    return list(dict.fromkeys(items))


# Flags left out take these: llama-7B's layer on a GPU (issue 28); on a CPU a small layer that shows each variant runs
# and matches eager in seconds (the llama-7B default ran for minutes there, and a CPU's timings say nothing of a GPU's)
GPU_DEFAULTS = {"hidden": 4096, "intermediate": 11008, "head_dim": 128, "tokens": "1,16,128,2048,8192",
                "variants": "all", "seconds": 1.0}
CPU_DEFAULTS = {"hidden": 256, "intermediate": 688, "head_dim": 64, "tokens": "16,64", "variants": "eager,patch",
                "seconds": 0.2}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.split("\n\n")[0])
    gpu, cpu = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--hidden", type=positive_int, help=f"hidden size (default {gpu['hidden']}; CPU {cpu['hidden']})")
    p.add_argument("--intermediate", type=positive_int,
                   help=f"MLP size (default {gpu['intermediate']}; CPU {cpu['intermediate']})")
    p.add_argument("--layers", type=positive_int, default=1, help="decoder layers (default %(default)s)")
    p.add_argument("--head-dim", type=positive_int,
                   help=f"heads = hidden / head-dim (default {gpu['head_dim']}; CPU {cpu['head_dim']})")
    p.add_argument("--tokens", help=f"comma list of M, tokens of one sequence (default {gpu['tokens']}; CPU "
                   f"{cpu['tokens']})")
    p.add_argument("--dtype", default="bf16", choices=MODEL_DTYPES, help="(default %(default)s)")
    p.add_argument("--variants", help=f"comma list of {', '.join(ALL_VARIANTS)}, or all (default: all: "
                   f"{', '.join(VARIANTS)}; CPU {cpu['variants']}); eager always runs, it is the reference")
    p.add_argument("--cudagraphs", action="store_true",
                   help=f"add {', '.join(CUDAGRAPH_VARIANTS)} (forward, M <= {CUDAGRAPH_MAX_TOKENS})")
    p.add_argument("--mode", default="fwd,fwdbwd", help="comma list of fwd, fwdbwd (default %(default)s)")
    p.add_argument("--seconds", type=positive, help=f"length of each timing loop (default {gpu['seconds']}; CPU "
                   f"{cpu['seconds']})")
    p.add_argument("--rounds", type=positive_int, default=2, help="loops per variant, alternated (default %(default)s)")
    p.add_argument("--heat", type=non_negative, default=1.0,
                   help="seconds of eager before a group's first round (default %(default)s)")
    p.add_argument("--stat", choices=tuple(STATS), default="median",
                   help="a variant's ms per step over its rounds (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (the input's is seed + 1)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees one, else cpu")
    p.add_argument("--json", metavar="PATH", help="JSON lines: a run header, then one line per (variant, M, mode)")
    p.add_argument("--time-limit", type=positive, metavar="S",
                   help="start no new variant after S seconds (the rest are recorded as skipped)")
    p.add_argument("--table-from", metavar="PATH", help="print the table of a saved --json run and exit")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    return p


def resolve(argv: list[str]) -> argparse.Namespace:
    """Parsed and checked arguments with `tokens`, `modes`, `variants` (lists) and `plan`; exit 2 with a usage error
    otherwise."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.device is None:
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        elif args.device == "cuda" and not torch.cuda.is_available() and not args.table_from:
            raise ArgumentsError("--device cuda: torch sees no CUDA GPU here")
        for name, value in (GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        args.tokens = parse_tokens(args.tokens)
        args.modes = parse_list(args.mode, "--mode", MODES)
        names = list(VARIANTS) if args.variants.strip() == "all" else parse_list(args.variants, "--variants",
                                                                                 ALL_VARIANTS)
        if args.cudagraphs:
            if args.device != "cuda" and not args.table_from:     # every CUDA-graph variant would fail its row
                raise ArgumentsError("--cudagraphs: CUDA graphs need --device cuda (a CUDA GPU); this run is on "
                                     f"{args.device}")
            names += [n for n in CUDAGRAPH_VARIANTS if n not in names]
        args.variants = ["eager"] + [n for n in names if n != "eager"]
        check_shape(args.hidden, args.intermediate, args.layers, args.head_dim)
    except (ArgumentsError, ModelShapeError) as e:
        parser.error(str(e))
    args.plan = LoopPlan(args.seconds, args.rounds, args.heat, args.stat)
    return args


def groups(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [(mode, tokens) for mode in args.modes for tokens in args.tokens]


def run(args: argparse.Namespace, progress: RunProgress, emit: Callable[[dict], None],
        runner: LoopRunner | None = None) -> tuple[dict, list[VariantResult]]:
    """Every (mode, M) group in turn, each record passed to `emit` as soon as its group ends."""
    fastpath = kernels.load_fastpath() if args.device == "cuda" else kernels.fastpath_status()
    header = {"kind": "run", "device": args.device, "hidden": args.hidden, "intermediate": args.intermediate,
              "layers": args.layers, "head_dim": args.head_dim, "dtype": args.dtype, "tokens": args.tokens,
              "modes": args.modes, "variants": args.variants, "seconds": args.plan.seconds,
              "rounds": args.plan.rounds, "heat": args.plan.heat, "stat": args.plan.stat, "seed": args.seed,
              "backends": ",".join(config.backends), "fastpath": fastpath, **environment()}
    emit(header)
    progress.note(f"{header['gpu']} ({args.device}): backends {header['backends']}; warm calls: {fastpath}")
    base = build_model(args.hidden, args.intermediate, args.layers, args.head_dim, args.dtype, args.device,
                       args.seed)
    setup = Setup(base, args.hidden, args.dtype, args.device, args.variants, args.plan, args.seed + 1, runner)

    def out_of_time() -> bool:
        return args.time_limit is not None and progress.elapsed > args.time_limit

    results: list[VariantResult] = []
    with progress:
        for mode, tokens in groups(args):
            try:
                group = measure_group(setup, mode, tokens, progress, out_of_time)
            except KeyboardInterrupt:       # the table of what was measured still prints
                break
            for r in group:
                results.append(r)
                emit(r.to_json())
                progress.note(summary_line(r))
            progress.advance()
    return header, results


def summary_line(r: VariantResult) -> str:
    if r.status != "ok":
        return f"{r.mode} M={r.tokens} {r.variant}: {r.status}: {r.message}"
    d = r.derived()
    speed = "" if d["speedup"] is None else f", {d['speedup']:.3f}x eager"
    err = "" if r.out_err is None else f", out err {r.out_err:.1e}"
    duels = "" if r.duel_s is None else f" (+ duels on {r.duel_steps} steps, {r.duel_s:.2f} s)"
    return (f"{r.mode} M={r.tokens} {r.variant}: cold {r.cold_s:.2f} s{duels}, {d['ms']:.4f} ms/step{speed}"
            f"{err}")


def _error(text: str) -> int:
    print(f"python -m bench.model: error: {text}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = resolve(list(sys.argv[1:] if argv is None else argv))
    if args.table_from:
        try:
            header, results = read_run(args.table_from)
        except (OSError, RunFileError) as e:
            return _error(str(e))
        print_table(results, table_title(header))
        return 0
    with contextlib.ExitStack() as stack:
        try:
            out = stack.enter_context(open(args.json, "w")) if args.json else None
        except OSError as e:
            return _error(f"--json {args.json}: {e}")

        def emit(record: dict) -> None:          # flushed per line: a killed run keeps what it measured
            if out is not None:
                out.write(json.dumps(record, default=str) + "\n")
                out.flush()
        progress = RunProgress(len(groups(args)), quiet=args.quiet)
        header, results = run(args, progress, emit)
    print_table(results, table_title(header))
    if args.json:
        progress.note(f"wrote {args.json}")
    return 1 if any(r.status == "error" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
