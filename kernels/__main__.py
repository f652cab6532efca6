"""`python -m kernels ...`:

    info                          what this machine offers the tuner, and why a backend would be left out
    config [--readme FILE]        the settings table (markdown), or write it into FILE between its settings markers
    warmup [--backends cutlass] [--dtypes bf16,fp16,int8] [--jobs N] [--arch N] [--retry-failed]
                                  build the default CUTLASS set ahead of time (no GPU needed: nvcc only)
    fastpath build [--force]      compile the C++ warm-call table for this torch/Python (retries a failed build)
    lut export [-o FILE]          a lookup table from the selection store (top-k per problem)
    lut check FILE                validate a lookup table and report what is used and what is skipped
    tune PROBLEMS... [--gpus all|0,1,...] [--time-limit S] [--jobs N] [--backends ...] [--dry-run]
                                  tune a CSV / JSON problem list or a recorded .jsonl trace ahead of time
    cache list | show KEY | export FILE [--problems P ...] | import FILE [--partial] | verify [--fix] |
          prune [--older-than DAYS] [--stale] | clear [--yes]
                                  the selection cache: inspect, move between machines (bundles), check, trim

Performance-model training lives outside the runtime: `python -m tools.perf_model --help`.

This module parses the command line and loads the commands (kernels.commands, and torch with them) only then, so
`tune --gpus` starts its workers first and their start-up overlaps this process's.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import sys

from kernels.core.config import ALL_BACKENDS, WARMUP_DTYPES, config
from kernels.core.errors import SettingError
from kernels.core.fsutil import json_file_problem
from kernels.tune import gpu_pool, worker_launch


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


def _days(text: str) -> float:
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of days")
    return days


def _names(kind: str, allowed: tuple[str, ...]):
    """An argparse type: a comma list of `allowed` names (a bad one is an argparse error naming the allowed ones)."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip().lower() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            what = f"unknown {kind} {', '.join(repr(n) for n in unknown)}" if unknown else f"no {kind} given"
            raise argparse.ArgumentTypeError(f"{what}; allowed: a comma list of {', '.join(allowed)}")
        return names
    return parse


def _positive(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


# NVIDIA's compute capabilities from 8.0 on (the CUTLASS templates here need 8.0 or newer)
ARCHES = (80, 86, 87, 89, 90, 100, 101, 103, 110, 120, 121)


def _arch(text: str) -> int:
    """A compute capability as 90, 9.0 or sm_90 -> 90; one no GPU has, or below 8.0, is refused here (nvcc would fail
    every kernel of the set on it, each recorded as a build failure)."""
    m = re.fullmatch(r"\s*(?:sm_?)?([0-9]{1,3})(?:\.([0-9]))?a?\s*", text.lower())
    arch = None
    if m is not None:
        major, minor = int(m.group(1)), m.group(2)
        # 9.0 -> 90; 9 and 10 as 9.0 and 10.0 (a major alone); 90 and 100 as they are
        arch = major * 10 + int(minor) if minor is not None else major * 10 if major < 20 else major
    if arch is None or arch not in ARCHES:
        what = ("below 8.0: the CUTLASS templates here need 8.0 or newer" if arch is not None and arch < 80 else
                "not a compute capability")
        raise argparse.ArgumentTypeError(f"{text!r} is {what} (one of {', '.join(str(a) for a in ARCHES)}, as 90, 9.0 "
                                         "or sm_90)")
    return arch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kernels", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the toolchain and backends")
    cfg = sub.add_parser("config", help="print the settings table (markdown, as the README carries it)")
    cfg.add_argument("--readme", metavar="FILE", help="write the table into FILE between its settings markers instead")

    wu = sub.add_parser("warmup", help="build the default CUTLASS set ahead of time (no GPU needed: nvcc only)")
    wu.add_argument("--backends", type=_names("backend", ALL_BACKENDS), default=("cutlass",),
                    help="comma list; only cutlass has kernels to build ahead (default cutlass)")
    wu.add_argument("--dtypes", type=_names("dtype", WARMUP_DTYPES), default=WARMUP_DTYPES,
                    help=f"comma list of {', '.join(WARMUP_DTYPES)} (default all)")
    wu.add_argument("--jobs", type=_positive, default=None, help="parallel compiles (default MAX_JOBS: the CPU count)")
    wu.add_argument("--arch", type=_arch, default=None,
                    help="compute capability to build for, as 90 or 80 (8.0 or newer; default this GPU's; "
                         "without one, 90)")
    wu.add_argument("--retry-failed", action="store_true",
                    help="compile again the kernels whose compile failed before (recorded, else never retried)")

    fp = sub.add_parser("fastpath", help="the C++ warm-call table").add_subparsers(dest="fastpath_command",
                                                                                  required=True, metavar="build")
    fpb = fp.add_parser("build", help="compile it now (normally built in the background on the first tune)")
    fpb.add_argument("--force", action="store_true", help="retry even when an earlier build failed")

    lut = sub.add_parser("lut", help="lookup tables").add_subparsers(dest="lut_command", required=True,
                                                                        metavar="export|check")
    exp = lut.add_parser("export", help="write a lookup table from the selection store")
    exp.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    exp.add_argument("--store", help="selection store directory (default: <cache dir>/selections)")
    exp.add_argument("--top-k", type=_positive, default=3, help="fastest choices kept per problem (default 3)")
    exp.add_argument("--mode", choices=("add", "only"), default="add",
                     help="add: the table's choices join the usual candidates; only: they replace them (default add)")
    chk = lut.add_parser("check", help="validate a lookup table")
    chk.add_argument("file", help="the lookup table (JSON) to check")

    tn = sub.add_parser("tune", help="tune a list of problems ahead of time: a CSV / JSON list or a recorded trace")
    tn.add_argument("problems", nargs="+", metavar="PROBLEMS",
                    help=".csv or .json of op, m, n, k, dtype, layout (nn, nt, tn, tt) [, bias, activation], or a "
                         ".jsonl trace recorded with KERNELS_RECORD / kernels.record(); several files allowed")
    tn.add_argument("--time-limit", type=_seconds, default=None, metavar="S",
                    help="start no new problem after S seconds (the rest is reported; run again to go on)")
    tn.add_argument("--jobs", type=_positive, default=None, help="parallel compiles (default MAX_JOBS: the CPU count)")
    tn.add_argument("--backends", type=_names("backend", ALL_BACKENDS), default=None,
                    help="comma list (default KERNELS_BACKENDS): the selections are stored for this backend set")
    tn.add_argument("--gpus", default=None, metavar="all|0,1,...",
                    help="spread the problems over these GPUs of this host: one worker process per device (default: "
                         "tune in this process, on the current GPU)")
    tn.add_argument("--dry-run", action="store_true", help="list the problems and which the store has; tune nothing")

    _cache_parser(sub)
    return parser


def _cache_parser(sub) -> None:
    cache = sub.add_parser("cache", help="the selection cache: list, show, export/import bundles, verify, prune, clear")
    cmds = cache.add_subparsers(dest="cache_command", required=True,
                                metavar="list|show|export|import|verify|prune|clear")
    cmds.add_parser("list", help="one line per stored selection: key, tuned when, final round, problem, winner")
    show = cmds.add_parser("show", help="a stored selection's table")
    show.add_argument("key", help="the key as `cache list` shows it (any unique prefix)")
    exp = cmds.add_parser("export", help="write selections and their winners' built kernels into one bundle file")
    exp.add_argument("file", help="the bundle to write (a .tar.gz)")
    exp.add_argument("--problems", nargs="+", metavar="P",
                     help="only these: key prefixes, shell patterns on the problem as `cache list` shows it, or "
                          "problem lists / traces (.csv, .json, .jsonl, as `tune` reads them)")
    imp = cmds.add_parser("import", help="add a bundle's selections and kernels to this cache (checked first)")
    imp.add_argument("file", help="the bundle to read")
    imp.add_argument("--partial", action="store_true",
                     help="import the selections for this environment and skip the others, rather than refuse")
    ver = cmds.add_parser("verify", help="check every stored selection and built artifact against its own check")
    ver.add_argument("--fix", action="store_true", help="remove what fails, so it is re-tuned or rebuilt")
    pr = cmds.add_parser("prune", help="remove old or stale selections (built artifacts stay: they are shared)")
    pr.add_argument("--older-than", type=_days, metavar="DAYS",
                    help="tuned more than DAYS days ago (and tune worker logs, killed writers' temporaries that old)")
    pr.add_argument("--stale", action="store_true",
                    help="recorded for another torch, Triton, kernels version or template sources than this one's")
    clr = cmds.add_parser("clear", help="remove what kernels made in the cache directory (selections, built "
                                        "kernels, logs)")
    clr.add_argument("--yes", action="store_true", help="do not ask")


def _tune_settings(args) -> bool:
    """Set this tune run's settings from its flags; False (the error printed, naming the setting) when one is bad."""
    try:
        if args.jobs is not None:
            config.max_jobs = args.jobs
        if args.backends is not None:
            config.backends = args.backends
        config.record = ""               # the lookups replay listed problems: they are not recorded again
        config.validate()
    except SettingError as e:
        print(f"python -m kernels tune: error: {e}", file=sys.stderr)
        return False
    if config.lut:
        # a call goes on without a table it cannot read (with a warning); a tune run would store every selection
        # without the table it was asked to use (a bad entry inside a readable table is skipped with a warning, as
        # in a call)
        why = json_file_problem(config.lut)
        if why is not None:
            print(f"python -m kernels tune: error: KERNELS_LUT={config.lut}: {why} (`python -m kernels lut check "
                  "FILE` validates a table)", file=sys.stderr)
            return False
    if config.cutlass_build == "background":
        config.cutlass_build = "inline"     # a kernel left to a background build would leave its problem to re-tune
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "tune" and not _tune_settings(args):
        return 2
    # SIGTERM and SIGHUP stop a command as ^C does: what it started (tune workers, ninja and its compilers, each in
    # their own process group) is ended on the way out instead of left running when the default action kills us
    try:
        with gpu_pool.terminations_as_interrupt():
            if args.command == "tune" and _may_tune_on_gpus(args):
                # workers started before torch is loaded: their start-up (seconds) overlaps this process's
                # (commands.run ends the ones the run did not adopt)
                return _run(args, worker_launch.start_early(args.gpus))
            return _run(args, None)
    except KeyboardInterrupt as e:
        why = f" ({e})" if str(e) else ""
        print(f"python -m kernels {args.command}: interrupted{why}", file=sys.stderr)
        return 130


def _run(args, early: worker_launch.EarlyWorkers | None) -> int:
    try:
        commands = importlib.import_module("kernels.commands")     # torch comes with the commands
    except BaseException:
        if early is not None:
            early.close()
        raise
    try:
        return commands.run(args, early)
    except SettingError as e:       # a bad KERNELS_* setting met by any command: its message names the variable
        print(f"python -m kernels {args.command}: error: {e}", file=sys.stderr)
        return 2


def _may_tune_on_gpus(args) -> bool:
    """Whether this tune run can hand problems to GPU workers at all, told without torch: --gpus, not a dry run,
    time to start one, and every listed file there (a missing one is the run's error to name)."""
    return (args.gpus is not None and not args.dry_run and (args.time_limit is None or args.time_limit > 0)
            and all(os.path.isfile(p) for p in args.problems))


if __name__ == "__main__":
    sys.exit(main())
