"""The commands of `python -m kernels` (kernels/__main__.py parses the command line, then loads this module: torch
comes with it). `run(args, early)` runs the parsed command; `early` holds the tune workers the CLI started before."""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from collections import Counter
from importlib import metadata
from pathlib import Path

import torch

from backends import get_backend
from kernels.core import progress
from kernels.core.cache_root import CACHE_ENTRIES, cache_root, problem_with
from kernels.core.config import ALL_BACKENDS, config, settings_markdown, with_readme_settings
from kernels.core.errors import SettingError
from kernels.core.fsutil import json_file_problem, read_regular_text
from kernels.core.problem import gpu_of, probe_problem
from kernels.core.toolchain import toolchain
from kernels.dispatch import record
from kernels.native import fastpath
from kernels.space import lut
from kernels.space.families import families_of
from kernels.store import bundle, cache_admin
from kernels.tune import background_build, build_queue, gpu_pool, offline, on_gpus, problem_list, warmup, worker_launch
from kernels.tune.autotune import fingerprint

# a README the settings table is written into: KiBs
MAX_README_BYTES = 16 << 20


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def _fastpath_line(mode: str) -> str:
    where = fastpath.paths()
    found = fastpath.state(where)
    if found == "built":
        return f"built ({where.library}); KERNELS_FASTPATH={mode}"
    if found == "unverified":
        return (f"{where.library} does not match its marker (truncated, replaced or not built here): never "
                f"loaded; removed and built again on the first tune, or by `python -m kernels fastpath build`")
    if found == "failed":
        return f"build failed (log: {where.log}); `python -m kernels fastpath build --force` retries"
    if found == "retry":
        return (f"not built: a build failed over a day ago (log: {where.log}); the next build tries again "
                f"(KERNELS_FASTPATH={mode})")
    return f"not built; KERNELS_FASTPATH={mode} ('auto' builds it in the background on the first tune)"


def info_lines(lines: list[str] | None = None) -> list[str]:
    """What `kernels info` prints, appended to `lines` as found (a bad setting raises SettingError part way)."""
    lines = [] if lines is None else lines
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
    config.validate()                # the lines below read the settings: a bad one ends here, named (exit 2)
    unusable = problem_with(Path(config.cache_dir))
    lines.append(f"cache dir: {config.cache_dir}" if unusable is None else
                 f"cache dir: {config.cache_dir} {unusable}: calls use a private temporary cache instead (gone at "
                 "exit), and the commands that build or read the cache refuse to run")
    lines.append(f"fastpath:  {_fastpath_line(config.fastpath)}")
    lines.append(f"backends:  configured {','.join(config.backends)}")
    problem = probe_problem(arch, name)
    for backend_name in ALL_BACKENDS:
        try:
            status = _backend_status(get_backend(backend_name), problem)
        except Exception as e:  # noqa: BLE001 - a backend that cannot even load is reported, not fatal
            status = f"unavailable: {type(e).__name__}: {e}"
        lines.append(f"  {backend_name:8s} {status}")
        for family in families_of(backend_name):
            lines.append(f"           {family.name} ({', '.join(family.ops)}): {family.what}")
    lines.extend(_cutlass_set_lines(arch, name))
    return lines


def _target(arch: int, name: str) -> tuple[int, str]:
    """The arch and device name CUTLASS builds for: this GPU's, else sm90 compile-only (as bench.compare does)."""
    return (arch, name) if arch else (warmup.DEFAULT_ARCH, f"sm{warmup.DEFAULT_ARCH} (compile-only)")


def _cutlass_set_lines(arch: int, name: str) -> list[str]:
    target, target_name = _target(arch, name)
    sets = [warmup.default_set(target, dtype, target_name) for dtype in warmup.DTYPES]
    if sets[0].why_not:
        return [f"cutlass set: none for sm{target}: {sets[0].why_not}"]
    return [f"cutlass set: sm{target}{'' if arch else ' (no GPU: compile-only)'}: {warmup.summary(sets)}; "
            f"`python -m kernels warmup` builds it",
            f"           KERNELS_CUTLASS_BUILD={config.cutlass_build}; background build: "
            f"{background_build.describe(build_queue.where())}"]


# the unaligned probe padded is asked about: bf16 rows of K=1001 elements start 2 bytes off a 16-byte boundary
PADDED_PROBE_K = 1001


def _backend_status(backend, problem) -> str:
    """Whether the backend serves problems on this machine, in words true here. `problem` is a made-up aligned bf16
    product on the first device, so each backend is asked about the problems it exists for."""
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
        if ok:
            return ("available through the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors, slowly; not bf16, "
                    "whose dot the interpreter gets wrong (triton issue #11584)")
        return ("no GPU: Triton runs only through its interpreter on CPU tensors, which TRITON_INTERPRET=1 turns on "
                "before triton is imported (bench.compare sets it)")
    return "available" if ok else f"unavailable: {why}"


def _lut_export(args) -> int:
    root = Path(args.store) if args.store else cache_root() / "selections"
    if args.store and not root.is_dir():
        print(f"python -m kernels lut export: error: --store {args.store}: no such directory", file=sys.stderr)
        return 2
    table = lut.export_from_store(root, args.top_k, args.mode)
    if args.output == "-":
        sys.stdout.write(lut.dumps(table))
    else:
        try:
            lut.save(table, args.output)
        except OSError as e:
            print(f"python -m kernels lut export: error: cannot write {args.output}: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    skipped = table.meta.get("epilogue_left_out", 0)
    print(f"{len(table.entries)} entries (top {args.top_k} per problem) from {root} -> {args.output}" +
          (f"; {skipped} problem(s) with a bias or activation left out (a table entry cannot say one)"
           if skipped else ""), file=sys.stderr)
    return 0


def _lut_check(args) -> int:
    why = json_file_problem(args.file)
    if why is not None:
        print(f"python -m kernels lut check: error: {args.file}: {why}", file=sys.stderr)
        return 2
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


def _fastpath_build(args) -> int:
    try:
        library = fastpath.build(force=args.force)
    except fastpath.FastpathBuildError as e:
        print(f"fastpath build failed: {e}", file=sys.stderr)
        if e.log:
            print(e.log[-4000:], file=sys.stderr)
        return 1
    print(library)
    return 0


def _config(args) -> int:
    if args.readme is None:
        sys.stdout.write(settings_markdown())
        return 0
    path = Path(args.readme)
    try:    # a regular file only: a FIFO named as the README is refused, never waited on
        path.write_text(with_readme_settings(read_regular_text(path, MAX_README_BYTES)))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"python -m kernels config: error: --readme {path}: {why}", file=sys.stderr)
        return 2
    print(f"settings table written into {path}", file=sys.stderr)
    return 0


def _warmup(args) -> int:
    try:
        if args.jobs is not None:
            config.max_jobs = args.jobs
        config.validate()
    except SettingError as e:
        print(f"python -m kernels warmup: error: {e}", file=sys.stderr)
        return 2
    status = 0
    for name in args.backends:
        if name != "cutlass":
            print(f"warmup: {name}: {warmup.NOTHING_TO_BUILD[name]}")
            continue
        status = max(status, _warmup_cutlass(args))
    return status


def _warmup_cutlass(args) -> int:
    gpu = torch.cuda.is_available()
    if args.arch is not None:
        arch, name = args.arch, f"sm{args.arch}"
    else:
        cap = torch.cuda.get_device_capability(0) if gpu else (0, 0)
        arch, name = _target(cap[0] * 10 + cap[1], torch.cuda.get_device_name(0) if gpu else "")
    sets = [warmup.default_set(arch, dtype, name) for dtype in args.dtypes]
    if sets[0].why_not:
        print(f"warmup: cutlass: cannot build for sm{arch}: {sets[0].why_not}", file=sys.stderr)
        return 1
    todo = warmup.to_build(sets, args.retry_failed)
    where = "" if gpu else " (no GPU here: compile-only)"
    print(f"warmup: cutlass for sm{arch}{where}: {warmup.summary(sets)}; building {todo} with {config.max_jobs} "
          f"parallel compiles (MAX_JOBS{', --jobs' if args.jobs else ''})", flush=True)
    with progress.bar(todo, "CUTLASS kernels compiled") as advance:
        try:
            result = warmup.warmup(sets, config.max_jobs, args.retry_failed, lambda done, total: advance(done))
        except TimeoutError as e:
            print(f"warmup: cutlass: another build held the lock too long: {e}", file=sys.stderr)
            return 1
    states = result.states
    print(f"warmup: cutlass: {warmup.summary(sets)}; compiled {result.compiled} in {result.seconds:.0f} s")
    if states["failed"]:
        retry = "" if args.retry_failed else " (recorded: not retried until --retry-failed)"
        print(f"warmup: {states['failed']} failed{retry}; logs:\n  " + "\n  ".join(result.failed_logs),
              file=sys.stderr)
    return 1 if states["failed"] or states["missing"] else 0


def _tune(args, early: worker_launch.EarlyWorkers | None) -> int:
    """Read the lists (every error names its file, line and column; the CLI has set this run's settings), then tune
    what the store lacks, or list it (--dry-run). Exit status: 0 done (problems left by --time-limit included), 1 a
    problem failed, 2 bad input or nothing to tune on, 130 interrupted."""
    try:
        listed = problem_list.read_all(args.problems)
        if not listed:
            raise problem_list.ProblemListError(f"{', '.join(args.problems)}: no problems listed")
    except problem_list.ProblemListError as e:
        print(f"python -m kernels tune: error: {e}", file=sys.stderr)
        return 2
    where = offline.target()
    if args.dry_run:
        print(offline.dry_run(listed, where, record.stored))
        return 0
    if where is None:
        print("python -m kernels tune: error: no GPU here (torch.cuda.is_available() is False): nothing to tune on. "
              "TRITON_INTERPRET=1 tunes through the Triton interpreter on CPU (slowly: tests); --dry-run lists what "
              "would be tuned", file=sys.stderr)
        return 2
    if where[0] == "cpu":
        # one line up front: a problem of 1024^3 takes minutes there, and nothing else is printed until it ends
        print("python -m kernels tune: no GPU: tuning through the Triton interpreter on CPU, which takes seconds for "
              "tiny problems and minutes for large ones (for tests; tune on the GPU machine)", file=sys.stderr,
              flush=True)
    if args.gpus is not None:
        try:
            devices = gpu_pool.parse_gpus(args.gpus, torch.cuda.device_count() if where[0] == "cuda" else 0)
            where = on_gpus.same_model(devices, gpu_of)
        except gpu_pool.GpuListError as e:
            print(f"python -m kernels tune: error: {e}", file=sys.stderr)
            return 2
        report = on_gpus.run(problem_list.retarget(listed, *where), devices, record.stored, args.time_limit,
                             early=early)
    else:
        report = offline.run(problem_list.retarget(listed, *where), record.stored, record.replay, args.time_limit)
    print(offline.summary(report))
    if report.stopped == "interrupted":
        return 130
    return 1 if report.count(offline.FAILED) else 0


def _cache(args) -> int:
    try:
        return _CACHE_COMMANDS[args.cache_command](args)
    except (bundle.BundleError, cache_admin.CacheAdminError) as e:
        print(f"python -m kernels cache {args.cache_command}: error: {e}", file=sys.stderr)
        return 1


def _cache_list(args) -> int:
    print("\n".join(cache_admin.list_lines()) or f"no stored selections in {cache_admin.selections_dir()}")
    return 0


def _cache_show(args) -> int:
    print(cache_admin.show_text(args.key))
    return 0


def _cache_export(args) -> int:
    items = args.problems or []
    absent = [p for p in items if p.endswith(problem_list.SUFFIXES) and not Path(p).is_file()]
    if absent:
        raise bundle.BundleError(f"--problems {', '.join(absent)}: no such problem list (a .csv, .json or .jsonl "
                                 "file); nothing exported")
    files = [p for p in items if p.endswith(problem_list.SUFFIXES)]
    try:
        listed = [item.problem for item in problem_list.read_all(files)] if files else None
    except problem_list.ProblemListError as e:
        raise bundle.BundleError(str(e)) from e
    report = bundle.export_bundle(Path(args.file), tuple(p for p in items if p not in files), listed)
    size = f"{report.size / 2**20:.1f} MiB" if report.size >= 2**20 else f"{report.size / 1024:.1f} KiB"
    print(f"{report.path}: {report.selections} selections, {report.artifacts} artifact files, {size}")
    _print_some("not carried (built on first use where it is imported)", report.missing)
    if report.skipped:
        print(f"left out {report.skipped} invalid store entries (`python -m kernels cache verify`)", file=sys.stderr)
    if report.not_stored:
        print(f"{report.not_stored} of the listed problems have no stored selection here (tune them first: "
              "`python -m kernels tune`)", file=sys.stderr)
    return 0


def _cache_import(args) -> int:
    report = bundle.import_bundle(Path(args.file), partial=args.partial, settings=fingerprint(config.backends))
    print(f"imported {len(report.imported)} selections into {cache_admin.selections_dir()}; artifact files: "
          f"{report.artifacts_written} written, {report.artifacts_present} already here; {len(report.kept)} kept "
          f"(a local entry as new or newer); {len(report.skipped)} skipped")
    _print_some("skipped", [f"{name}: {why}" for name, why in report.skipped])
    _print_some("note", report.notes)
    return 0


def _print_some(label: str, lines: list[str], limit: int = 10) -> None:
    for line in lines[:limit]:
        print(f"  {label}: {line}", file=sys.stderr)
    if len(lines) > limit:
        print(f"  ... and {len(lines) - limit} more", file=sys.stderr)


def _cache_verify(args) -> int:
    report = cache_admin.verify(fix=args.fix)
    print("checked: " + ", ".join(f"{what}: {n}" for what, n in report.checked.items()))
    for bad in report.bad:
        print(f"  bad {bad.what}: {bad.path}: {bad.why}")
    if report.bad and args.fix:
        print(f"removed {report.removed} (rebuilt or re-tuned when next needed)")
    elif report.bad:
        print(f"{len(report.bad)} bad; `--fix` removes them so they are rebuilt")
    return 1 if report.bad and not args.fix else 0


def _cache_prune(args) -> int:
    report = cache_admin.prune(args.older_than, args.stale)
    logs = f"; {report.logs_removed} old tune worker logs" if report.logs_removed else ""
    logs += (f"; {report.temporaries_removed} temporary files killed writers left" if report.temporaries_removed
             else "")
    print(f"removed {len(report.removed)} selections, kept {report.kept} (built artifacts are left: they are shared)"
          f"{logs}")
    return 0


def _cache_clear(args) -> int:
    where = cache_admin.root()
    if not args.yes:
        if not sys.stdin.isatty():
            print(f"python -m kernels cache clear: refusing to empty {where} without --yes", file=sys.stderr)
            return 1
        if input(f"remove what kernels made in {where}? [y/N] ").strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return 1
    try:
        removed = cache_admin.clear()
    except OSError as e:
        print(f"python -m kernels cache clear: error: cannot remove {e.filename or where}: {e.strerror or e}",
              file=sys.stderr)
        return 1
    print(f"removed {removed} entries from {where}")
    return 0


_CACHE_COMMANDS = {"list": _cache_list, "show": _cache_show, "export": _cache_export, "import": _cache_import,
                   "verify": _cache_verify, "prune": _cache_prune, "clear": _cache_clear}


def _needs_the_cache(args) -> bool:
    """Whether the command builds into or reads from the cache directory (info and config only describe it; lut check
    reads its file; lut export --store reads that store)."""
    if args.command in ("info", "config"):
        return False
    if args.command == "lut":
        return args.lut_command == "export" and not args.store
    return True


def _writes_the_cache(args) -> bool:
    """Whether the command's work is what it writes there (a tune's selections, built kernels, an import, removals)."""
    if args.command == "tune":
        return not args.dry_run
    if args.command == "cache":
        return args.cache_command in ("import", "prune", "clear") or (args.cache_command == "verify" and args.fix)
    return args.command in ("warmup", "fastpath")


def _entry_problem(base: Path, writes: bool, entries: tuple[str, ...] = CACHE_ENTRIES) -> str | None:
    """Why the cache directory, or one of the `entries` kernels keeps at its top, cannot serve the command: an entry
    that is not a folder, or (`writes`) one it cannot write; None when all can."""
    unwritable = " (a read-only file system or a mode)"
    if writes and not os.access(base, os.W_OK | os.X_OK):
        return "cannot be written" + unwritable
    for name in entries:
        path = base / name
        if not os.path.lexists(path):
            continue
        if path.is_symlink() or not path.is_dir():
            return f"holds {name}, which is not a folder (`python -m kernels cache clear` removes it)"
        if writes and not os.access(path, os.W_OK | os.X_OK):
            return f"cannot be written in {name}" + unwritable
    return None


def _cache_unusable(args) -> str | None:
    """The error line when the command needs the cache directory and it fails its checks. A call falls back to a
    private temporary cache with a warning; a command would then build or read there, and what it built (a warmup's
    kernels, a tune's selections, the C++ table, an imported bundle) would be gone at exit."""
    if not _needs_the_cache(args):
        return None
    # clear is how a broken entry is repaired (it removes it): only the directory itself must serve it
    clearing = args.command == "cache" and args.cache_command == "clear"
    why = problem_with(Path(config.cache_dir))
    if why is None:
        why = _entry_problem(Path(config.cache_dir), _writes_the_cache(args), () if clearing else CACHE_ENTRIES)
    if why is None:
        return None
    command = f"{args.command} {args.cache_command}" if args.command == "cache" else args.command
    return (f"python -m kernels {command}: error: the cache directory {config.cache_dir} (KERNELS_CACHE_DIR) "
            f"{why}; this command builds or reads there. Fix it, or set KERNELS_CACHE_DIR to a directory of yours")


def run(args, early: worker_launch.EarlyWorkers | None = None) -> int:
    """Run the parsed command line. The tune workers in `early` are the tune run's to adopt; any it does not are
    ended here."""
    try:
        unusable = _cache_unusable(args)
        if unusable is not None:
            print(unusable, file=sys.stderr)
            return 2
        if args.command == "info":
            lines: list[str] = []
            try:
                info_lines(lines)
            finally:                 # what was found before a bad setting is shown too
                print("\n".join(lines), flush=True)
            return 0
        if args.command == "config":
            return _config(args)
        if args.command == "warmup":
            return _warmup(args)
        if args.command == "fastpath":
            return _fastpath_build(args)
        if args.command == "tune":
            # no calls follow an offline tune to run its duels on: they run in the tune (and only for this run, when
            # main() is called from Python)
            with config.temporarily(duel="loop"):
                return _tune(args, early)
        if args.command == "lut":
            return _lut_export(args) if args.lut_command == "export" else _lut_check(args)
        if args.command == "cache":
            return _cache(args)
        raise AssertionError(f"unhandled command {args.command!r}")    # argparse's `required=True` rules it out
    finally:
        if early is not None:
            early.close()
