"""`python -m bench.model_ddp`: bench.model's decoder stack trained forward+backward under DistributedDataParallel,
one process per GPU, plain (`eager`) and through `kernels.patch` (`patch`) (issue 31): each variant's first step
(patch's tunes every forward and backward problem; ranks meeting one new problem tune it once), its kernels.stats()
counters per rank, patch's loss and grads against eager's, then steps/s and global tokens/s.

    python -m bench.model_ddp --json ddp.jsonl                  # every visible GPU, llama-7B's layer, bf16, M = 4096
    python -m bench.model_ddp --gpus 2 --tokens 2048 --layers 2
    torchrun --nproc-per-node 2 -m bench.model_ddp              # one rank per process, started by torchrun
    python -m bench.model_ddp --device cpu --gpus 2 --hidden 32 --intermediate 64 --head-dim 16 --tokens 8 \\
        --dtype fp32 --seconds 0.05 --rounds 1                  # 2 CPU processes over gloo: a check, not a measurement

Without torchrun (RANK, WORLD_SIZE, LOCAL_RANK unset) it spawns --gpus processes itself (rendezvous on 127.0.0.1 at a
free port), --gpus 1 included, so one GPU's first step and two GPUs' go through the same code. Every rank builds the
same seeded weights; rank r's input is drawn from seed + 1 + r. Rank 0 prints the table and writes --json. Every
process gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1 before NCCL starts
(bench/ddp_world.py says why); a rank stuck at a collective fails after --timeout.

The first step's tuning on one GPU against two, each from an empty selection store: KERNELS_CACHE_DIR is the cache
(selections, built Triton and CUTLASS kernels, the C++ warm-call table). `python -m kernels cache prune --older-than 0`
removes every selection and keeps the built kernels; `python -m kernels cache clear --yes` removes everything in it.
Build once, then time each first step on the same built kernels (compiles then stay 0 in the first-step column):

    export KERNELS_CACHE_DIR=$(mktemp -d)
    python -m bench.model_ddp --gpus 1 --rounds 1               # builds what the tunes compile; not the measurement
    python -m kernels cache prune --older-than 0 && python -m bench.model_ddp --gpus 1 --json ddp1.jsonl
    python -m kernels cache prune --older-than 0 && python -m bench.model_ddp --gpus 2 --json ddp2.jsonl

(or a fresh `KERNELS_CACHE_DIR=$(mktemp -d)` per run: fully cold, compiles included.)
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch
import torch.multiprocessing as mp

import kernels
from bench.cli_common import positive, positive_int
from bench.ddp_world import World, WorldError, init, keep_multicast_off, shutdown, spawn, torchrun_world
from bench.device import environment
from bench.model_ddp_rank import DdpPlan, measure
from bench.model_ddp_report import DdpVariantResult, print_table, table_title
from bench.model_def import MODEL_DTYPES, ModelShapeError, check_shape
from kernels.core.config import config

PROG = "python -m bench.model_ddp"
CPU_WORLD = 2          # --device cpu without --gpus: the smallest world that all-reduces anything


# the llama-7B layer on GPUs; a small one on the CPU's gloo processes (bench.model's CPU sizes)
GPU_DEFAULTS = {"hidden": 4096, "intermediate": 11008, "head_dim": 128, "tokens": 4096}
CPU_DEFAULTS = {"hidden": 256, "intermediate": 688, "head_dim": 64, "tokens": 64}


class ArgumentsError(ValueError):
    """A flag's value that cannot run here; the message names the flag."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    gpu, cpu = GPU_DEFAULTS, CPU_DEFAULTS
    p.add_argument("--hidden", type=positive_int, help=f"hidden size (default {gpu['hidden']}; CPU {cpu['hidden']})")
    p.add_argument("--intermediate", type=positive_int,
                   help=f"MLP size (default {gpu['intermediate']}; CPU {cpu['intermediate']})")
    p.add_argument("--layers", type=positive_int, default=1, help="decoder layers (default %(default)s)")
    p.add_argument("--head-dim", type=positive_int,
                   help=f"heads = hidden / head-dim (default {gpu['head_dim']}; CPU {cpu['head_dim']})")
    p.add_argument("--tokens", type=positive_int,
                   help=f"M of each rank's input (default {gpu['tokens']}; CPU {cpu['tokens']})")
    p.add_argument("--dtype", default="bf16", choices=MODEL_DTYPES, help="(default %(default)s)")
    p.add_argument("--seconds", type=positive, default=1.0,
                   help="length of each timing loop, the slowest rank's clock (default %(default)s)")
    p.add_argument("--rounds", type=positive_int, default=2, help="loops per variant, alternated (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="the weights' seed (rank r's input: seed + 1 + r)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when torch sees one, else cpu")
    p.add_argument("--gpus", type=positive_int, metavar="N",
                   help=f"processes, one per GPU (default: every visible GPU; --device cpu: {CPU_WORLD} gloo "
                        "processes); under torchrun its world size")
    p.add_argument("--timeout", type=positive, default=600.0, metavar="S",
                   help="seconds a rank waits at a collective before the run fails (default %(default)s)")
    p.add_argument("--json", metavar="PATH", help="JSON lines: a run header, then one line per variant")
    return p


def resolve(argv: list[str]) -> argparse.Namespace:
    """Checked arguments with `world` (this process's rank under torchrun, else None) and `gpus` (the world size);
    exit 2 with a message naming the flag otherwise."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.device is None:
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        for name, value in (GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS).items():
            if getattr(args, name) is None:     # on the CPU a layer of the GPU's size ran for minutes, silently
                setattr(args, name, value)
        check_shape(args.hidden, args.intermediate, args.layers, args.head_dim)
        visible = torch.cuda.device_count() if args.device == "cuda" else None
        if visible == 0:
            raise ArgumentsError("--device cuda: torch sees no CUDA GPU here")
        args.world = torchrun_world(args.device)
        if args.world is not None:
            if args.gpus is not None and args.gpus != args.world.size:
                raise ArgumentsError(f"--gpus {args.gpus}: torchrun started WORLD_SIZE={args.world.size} processes "
                                      "(leave --gpus out under torchrun)")
            args.gpus = args.world.size
            if visible is not None and args.world.local_rank >= visible:
                raise ArgumentsError(f"LOCAL_RANK={args.world.local_rank}: torch sees {visible} CUDA GPUs here")
        elif args.gpus is None:
            args.gpus = visible if visible is not None else CPU_WORLD
        elif visible is not None and args.gpus > visible:
            raise ArgumentsError(f"--gpus {args.gpus}: torch sees {visible} CUDA GPU{'s' * (visible != 1)} here")
    except (ArgumentsError, ModelShapeError, WorldError) as e:
        parser.error(str(e))
    args.plan = DdpPlan(args.hidden, args.intermediate, args.layers, args.head_dim, args.tokens, args.dtype,
                        args.device, args.seconds, args.rounds, args.seed, args.timeout)
    return args


def header(world: World, plan: DdpPlan, devices: list[str], fastpath: str, multicast: dict) -> dict:
    nccl = torch.cuda.nccl.version() if world.device == "cuda" else "none"      # (2, 21, 5), or an int before
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return {"kind": "run", "world_size": world.size, "launcher": world.launcher, "backend": world.backend,
            "devices": devices, "device": plan.device, "hidden": plan.hidden, "intermediate": plan.intermediate,
            "layers": plan.layers, "head_dim": plan.head_dim, "dtype": plan.dtype, "tokens": plan.tokens,
            "global_tokens": plan.tokens * world.size, "seconds": plan.seconds, "rounds": plan.rounds,
            "stat": plan.stat, "seed": plan.seed, "timeout_s": plan.timeout_s, "backends": ",".join(config.backends),
            "fastpath": fastpath, "nccl": nccl, "multicast_env": multicast, **environment()}


def _write(run: dict, results: list[DdpVariantResult], json_path: str | None) -> None:
    if json_path:
        with open(json_path, "w") as out:
            for record in [run] + [r.to_json() for r in results]:
                out.write(json.dumps(record, default=str) + "\n")
    print_table(results, table_title(run))
    if json_path:
        print(f"wrote {json_path}", file=sys.stderr)


def run_rank(world: World, plan: DdpPlan, json_path: str | None) -> int:
    """One rank's whole run: join the group, measure, rank 0 reports; 1 when a variant failed, else 0."""
    multicast = keep_multicast_off()
    comm = init(world, datetime.timedelta(seconds=plan.timeout_s))
    try:
        # the C++ warm-call table built or loaded now, not inside a first step
        fastpath = kernels.load_fastpath() if world.device == "cuda" else kernels.fastpath_status()
        devices = comm.gather(torch.cuda.get_device_name(world.local_rank) if world.device == "cuda" else "cpu")
        results = measure(world, comm, plan)
        if world.rank == 0:
            _write(header(world, plan, devices, fastpath, multicast), results, json_path)
        comm.barrier()           # no rank leaves (and tears the group down) while rank 0 still writes
    finally:
        shutdown()
    return 1 if any(r.status != "ok" for r in results) else 0


def rank_entry(index: int, size: int, plan: DdpPlan, json_path: str | None, done) -> None:
    """A spawned process: rank `index` of `size` on GPU `index`; rank 0 hands its exit code back through `done`."""
    rc = run_rank(World(index, size, index, plan.device, "spawn"), plan, json_path)
    if index == 0:
        done.put(rc)                # a SimpleQueue: written to its pipe before put returns
    # The rank's work is done, reported and its process group destroyed. The interpreter's own teardown can still
    # abort in gloo's threads (std::terminate, SIGABRT: once in a CI simulation, after the JSON was written), and
    # spawn would call that a failed rank; nothing is left to tear down that the OS does not.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    keep_multicast_off()                 # first: nothing may start NCCL before these are set
    args = resolve(list(sys.argv[1:] if argv is None else argv))
    if args.json and (args.world is None or args.world.rank == 0):
        try:
            open(args.json, "w").close()     # an unwritable path fails here, not after the run
        except OSError as e:
            print(f"{PROG}: error: --json {args.json}: {e}", file=sys.stderr)
            return 2
    if args.world is not None:
        return run_rank(args.world, args.plan, args.json)
    done = mp.get_context("spawn").SimpleQueue()
    try:
        spawn(rank_entry, args.gpus, (args.gpus, args.plan, args.json, done))
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"{PROG}: a rank failed, the run ended: {str(e).strip()[-2000:]}", file=sys.stderr)
        return 1
    with contextlib.suppress(Exception):
        if not done.empty():
            return done.get()
    return 1


if __name__ == "__main__":
    sys.exit(main())
