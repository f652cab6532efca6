"""CUTLASS backend: render one .cu per config, build a batch with one `ninja -jN`, load the .so with ctypes and
launch on torch's current stream. Runners are isolated (CutlassBackend.isolated): verification and timing
run in a child process (backends/isolated_child.py), so a faulting kernel cannot poison the caller's CUDA context.
A problem with an epilogue (bias, activation) gets kernels that fuse it (backends.cutlass_render): their entry point
takes the bias pointer after B, and the launch is launch(a, b, bias, out=None). A scaled fp8 product's (scaled_mm)
takes the two scale pointers, then the bias's: launch(a, b, scale_a, scale_b[, bias], out=None).

Artifacts: <cache_dir>/cutlass/sm<arch>/<key>/{kernel.cu, kernel.so, build.log, meta.json, failed.json}; key =
source hash + nvcc version + flags + arch + CUTLASS version. `meta.json` is written last and records the binary's
size and hash: an entry without a matching marker is a miss and is rebuilt. `failed.json` records a compile that
failed (this key's compiler output tail): background and `off` builds do not retry it (inline builds do, and
`python -m kernels warmup --retry-failed`).

A build with more kernels than parallel compiles puts them two to a translation unit (`translation_units`,
cutlass_render.batch_source: the CUTLASS headers parsed once per unit, entry points suffixed by the key's head); each
member's kernel.so is then a hard link of the unit's shared object, with its own marker. The loader takes the suffixed
entry points, else the plain ones.

How a tune gets binaries it lacks (KERNELS_CUTLASS_BUILD): `inline` compiles them in the tune; `background` loads
what is built and hands back the rest as pending (kernels.tune.background_build builds them in a low-priority
process); `off` loads what is built (`python -m kernels warmup`) and reports the rest as not built.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.base import Backend, BuildOutcome, Runner
from backends.cutlass_render import (
    ENTRY_POINTS,
    BuildJob,
    CutlassKernelSpec,
    batch_source,
    build_key,
    ninja_text,
    render,
    spec_for,
    symbol_suffix,
)
from kernels.core.cache_root import cache_root, refuse_foreign
from kernels.core.choice import NAME_FILTERED, Choice, name_filter
from kernels.core.config import config
from kernels.core.counters import bump as bump_stat
from kernels.core.detached import run_in_group
from kernels.core.errors import BuildError, KernelsError
from kernels.core.fsutil import (
    atomic_write_text,
    file_lock,
    make_private_dirs,
    marker_claims,
    marker_valid,
    read_json,
    read_tail,
    write_if_different,
)
from kernels.core.fsutil import publish_marker as fs_publish_marker
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.core.toolchain import Toolchain, toolchain
from kernels.space.heuristics_cutlass import (
    CutlassConfig,
    kernel_operands,
    ranked_configs,
    select,
    superseded,
    templates_for,
)

LOG_TAIL_CHARS = 1500
# CUTLASS candidates built per problem in the default search space, the best-ranked by kernels.space.heuristics_cutlass
# first. What 12 costs: a cold build and tune of the default set (12 configs, 22 choices with run-time swizzles) took
# 61 s on a lent 16-core H200 host, the next shape of that dtype 6-7 s with no compile; other limits were not compared
CUTLASS_MAX_CONFIGS = 12


class CutlassLaunchError(KernelsError):
    """A CUTLASS entry point returned a non-zero cutlass::Status."""


@dataclass(frozen=True)
class ArtifactPaths:
    root: Path

    @property
    def source(self) -> Path:
        return self.root / "kernel.cu"

    @property
    def binary(self) -> Path:
        return self.root / "kernel.so"

    @property
    def log(self) -> Path:
        return self.root / "build.log"

    @property
    def marker(self) -> Path:
        return self.root / "meta.json"

    @property
    def failed(self) -> Path:
        return self.root / "failed.json"


def publish_marker(paths: ArtifactPaths, key: str, info: dict) -> None:
    fs_publish_marker(paths.binary, paths.marker, key, info)
    with contextlib.suppress(FileNotFoundError):
        paths.failed.unlink()           # an inline build or a retry succeeded where an earlier one failed


def artifact_valid(paths: ArtifactPaths, key: str) -> bool:
    return marker_valid(paths.binary, paths.marker, key)


def record_failure(paths: ArtifactPaths, key: str, message: str) -> None:
    """Remember that this key's compile failed, so background builds do not retry it on every tune."""
    try:
        atomic_write_text(paths.failed, json.dumps({"key": key, "message": message[-LOG_TAIL_CHARS:]}))
    except OSError:
        pass                # not recorded: the next background build tries again, which is all it costs


def recorded_failure(paths: ArtifactPaths, key: str) -> str | None:
    """The recorded compile failure of this key, or None (none, or a record that is not one: ignored)."""
    data = read_json(paths.failed)
    if data is None or data.get("key") != key or not isinstance(data.get("message"), str):
        return None
    return data["message"]


def artifact_state(paths: ArtifactPaths, key: str) -> str:
    """'built', 'failed' or 'missing', without reading the binary (marker_claims): what a cold lookup, `kernels
    info` and warmup ask. Loading still checks the hash."""
    if marker_claims(paths.binary, paths.marker, key) is not None:
        return "built"
    return "failed" if recorded_failure(paths, key) is not None else "missing"


# -- loading and launching ----------------------------------------------------------------------------------------
@dataclass
class LoadedKernel:
    workspace_size: object       # ctypes function
    run: object


def load_library(path: Path, epilogue_operands: int = 0, suffix: str = "") -> LoadedKernel:
    """The entry points of a built kernel; `epilogue_operands`: how many pointers its run takes between B and D
    (problem.epilogue_operands: the bias; scaled_mm's two scales, then the bias). `suffix`: the names' suffix when
    the binary was built in a batch (cutlass_render.symbol_suffix); its plain names are tried when it has none."""
    refuse_foreign(path, "the CUTLASS kernel")        # a folder others can write: its marker vouches for nothing
    lib = ctypes.CDLL(str(path))
    ws_name, run_name = (name + suffix if suffix and hasattr(lib, name + suffix) else name for name in ENTRY_POINTS)
    ws = getattr(lib, ws_name)
    ws.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
    ws.restype = ctypes.c_int
    run = getattr(lib, run_name)
    pointers = 3 + int(epilogue_operands)    # A, B, [scale_a, scale_b,] [bias,] D
    run.argtypes = [*[ctypes.c_void_p] * pointers, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                    ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    run.restype = ctypes.c_int
    return LoadedKernel(ws, run)


def _leading_dim(problem: GemmProblem, which: str) -> int:
    # a size-1 dimension's stride is arbitrary: any value >= 1 is a valid leading dimension there (strided operands
    # never get here: the CUTLASS heuristics offer no kernel for them)
    return max(problem.leading_dim(which) or 1, 1)


def _needs_staging(out: torch.Tensor, n: int, align_c: int) -> bool:
    """The kernels write row-major rows whose starts are 16-byte aligned; any other `out` gets a copy."""
    if out.stride(1) != 1 and out.shape[1] != 1:
        return True
    if out.data_ptr() % 16:
        return True
    return out.shape[0] > 1 and (out.stride(0) % align_c != 0 or out.stride(0) < n)


def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """The bias as the kernels read it: unit stride from a 16-byte aligned start (sm80 loads it as the C operand in
    whole vectors); any other gets a copy, which a fresh allocation aligns."""
    if bias.data_ptr() % 16 == 0 and (bias.stride(0) == 1 or bias.shape[0] <= 1):
        return bias
    return bias.clone(memory_format=torch.contiguous_format)


def _contiguous_scale(scale: torch.Tensor) -> torch.Tensor:
    """A scale as the kernels read it: fp32 elements at unit stride (kernels.scaled_mm asks for contiguous scales; a
    direct runner call with another gets a copy)."""
    return scale if scale.is_contiguous() else scale.contiguous()


def make_launcher(kernel: LoadedKernel, problem: GemmProblem, cfg: CutlassConfig):
    """launch(a, b, out=None), launch(a, b, bias, out=None) for a bias problem, or launch(a, b, scale_a, scale_b[,
    bias], out=None) for a scaled one, for one problem: kernel-coordinate M/N, operand order and leading dims fixed up
    front. The epilogue's pointers go in the problem's order whether or not the kernel computes C^T: the kernel
    knows which of its axes each vector runs along."""
    ops = kernel_operands(problem, cfg.swap)
    m, n, k = ops.m, ops.n, problem.k
    ld = {"a": _leading_dim(problem, "a"), "b": _leading_dim(problem, "b")}
    first, second = ops.a_is, ops.b_is
    lda, ldb = ld[first], ld[second]
    swizzle = cfg.swizzle
    size = ctypes.c_size_t(0)
    status = kernel.workspace_size(m, n, k, swizzle, ctypes.byref(size))
    if status != 0:
        raise CutlassLaunchError(f"workspace size query failed with cutlass::Status {status}")
    ws_bytes = size.value
    shape, dtype = (problem.m, problem.n), DTYPES_BY_NAME[problem.out_dtype]
    run = kernel.run
    raw_stream = torch._C._cuda_getCurrentRawStream
    current_device = getattr(torch._C, "_cuda_getDevice", None)      # absent from CPU builds (tests' fake kernels)

    def call(a, b, epi, out):
        """`epi`: the epilogue's tensors as the entry point takes them after B ((), (bias,) or the scales[, bias])."""
        if out is not None and _needs_staging(out, problem.n, cfg.align_c):
            out.copy_(call(a, b, epi, None))
            return out
        device = a.device
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes else None
        ptrs = {"a": a.data_ptr(), "b": b.data_ptr()}
        ldc = out.stride(0) if out.shape[0] > 1 else problem.n
        args = (ptrs[first], ptrs[second], *[t.data_ptr() for t in epi], out.data_ptr(), m, n, k, lda, ldb, ldc,
                ws.data_ptr() if ws is not None else None, swizzle, raw_stream(device.index))
        if current_device is None or current_device() == device.index:
            status = run(*args)
        else:       # the runtime launches into the current device's context: the operands' must be current
            with torch.cuda.device(device.index):
                status = run(*args)
        if status != 0:
            raise CutlassLaunchError(f"cutlass::Status {status} from {cfg.tag()} on {problem.short()}")
        return out

    if problem.scaling and problem.bias:
        def launch(a, b, scale_a, scale_b, bias, out=None):
            return call(a, b, (_contiguous_scale(scale_a), _contiguous_scale(scale_b), _aligned_bias(bias)), out)
    elif problem.scaling:
        def launch(a, b, scale_a, scale_b, out=None):
            return call(a, b, (_contiguous_scale(scale_a), _contiguous_scale(scale_b)), out)
    elif problem.bias:
        def launch(a, b, bias, out=None):
            return call(a, b, (_aligned_bias(bias),), out)
    else:
        def launch(a, b, out=None):
            return call(a, b, (), out)
    return launch


# ninja's status line on a pipe: printed as each edge finishes, "[finished/total] "
_NINJA_STATUS = re.compile(r"^\[(\d+)/(\d+)\] ")


def run_ninja(nvcc: str, jobs: list[BuildJob], batches_dir: Path, max_jobs: int, on_progress=None) -> None:
    """Build every job with one `ninja -jN`, keeping going past failures: a job succeeded iff its output exists.
    ninja and its compilers run in their own process group, killed with it when the build is interrupted.
    `on_progress(done, total)` is called as each compile finishes."""
    text = ninja_text(nvcc, jobs)
    batch = batches_dir / hashlib.sha256(text.encode()).hexdigest()[:16]
    write_if_different(batch / "build.ninja", text)
    for job in jobs:
        make_private_dirs(job.log.parent)

    def on_line(line: str) -> None:
        match = _NINJA_STATUS.match(line)
        if match:
            on_progress(int(match[1]), int(match[2]))

    try:
        run_in_group(["ninja", "-C", str(batch), "-k", "0", f"-j{max_jobs}"],
                     on_line=on_line if on_progress is not None else None)
    except OSError as e:
        raise BuildError(f"could not run ninja: {e}") from e


# Kernels per translation unit at most, when a build has more kernels than parallel compiles: nvcc parses the CUTLASS
# headers once per unit (27 s of an 85 s single-kernel compile on a 2-core host; two kernels in one unit 131 s against
# 170 s apart), and the default bf16 set's 31 kernels were two waves of compiles on 16 cores (107 s on the H200 host;
# 27 kernels in units of two: 88 s). Two, not more: one sm90 kernel's compile already takes ~3 GB (fp8 ~3.5 GB)
MAX_UNIT_KERNELS = 2


def translation_units(prepared: list, slots: int, most: int = MAX_UNIT_KERNELS) -> list[list]:
    """`prepared` split into translation units: one kernel each while they fit `slots` parallel compiles, else as
    few waves of compiles as units of at most `most` kernels allow, the units as even as those waves let them be;
    only kernels built with the same flags share one."""
    slots = max(1, slots)
    waves = max(1, math.ceil(len(prepared) / (slots * most)))
    size = min(most, max(1, math.ceil(len(prepared) / (slots * waves))))
    by_flags: dict[tuple, list] = {}
    for p in prepared:
        by_flags.setdefault(p.spec.flags, []).append(p)
    return [group[i:i + size] for group in by_flags.values() for i in range(0, len(group), size)]


def _place_binary(unit: Path, binary: Path, unit_log: Path, log: Path) -> None:
    """Publish a unit's shared object as one member's binary (a hard link, a copy across file systems), by rename:
    never a partial file under the final name. The unit's compiler output becomes the member's log."""
    tmp = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        try:
            os.link(unit, tmp)
        except OSError:
            shutil.copyfile(unit, tmp)
        os.replace(tmp, binary)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    with contextlib.suppress(OSError):
        shutil.copyfile(unit_log, log)


# -- the backend --------------------------------------------------------------------------------------------------
@dataclass
class _Prepared:
    index: int
    choice: Choice
    spec: CutlassKernelSpec
    key: str
    paths: ArtifactPaths
    start: float
    source: str


class CutlassBackend(Backend):
    name = "cutlass"
    isolated = True
    epilogues = True

    def __init__(self, tools: Toolchain | None = None, max_configs: int = CUTLASS_MAX_CONFIGS):
        self._tools = tools
        self.max_configs = max_configs
        self._libraries: dict[Path, LoadedKernel] = {}

    @property
    def tools(self) -> Toolchain:
        return self._tools if self._tools is not None else toolchain()

    @property
    def root(self) -> Path:
        return cache_root() / "cutlass"

    def artifact_paths(self, problem: GemmProblem, choice: Choice) -> tuple[str, ArtifactPaths, str]:
        """(key, paths, source) of the binary `choice` needs for `problem`."""
        spec = spec_for(problem, choice)
        source = render(spec)
        key = build_key(source, spec, self.tools.nvcc_version, self.tools.cutlass.version if self.tools.cutlass else "")
        return key, ArtifactPaths(self.root / f"sm{spec.arch}" / key), source

    # -- Backend ----------------------------------------------------------------------------------------------
    def available(self, problem: GemmProblem) -> tuple[bool, str]:
        if problem.device != "cuda":
            return False, "CUTLASS kernels need CUDA tensors"
        if problem.op == "mm" and problem.dtype not in ("fp16", "bf16"):
            return False, f"CUTLASS templates here take fp16/bf16 for mm, not {problem.dtype}"
        if problem.arch < 80:
            return False, f"CUTLASS templates here need compute capability >= 8.0, device has {problem.arch / 10:.1f}"
        tools = self.tools
        if not tools.usable:
            return False, tools.message
        if shutil.which("ninja") is None:
            return False, "ninja is not on PATH (pip install ninja)"
        return True, ""

    def choices(self, problem, space="default"):
        skipped: dict[str, str] = {}
        ranked: dict[str, list[CutlassConfig]] = {}
        for template in templates_for(problem.op):
            cfgs, rejected = ranked_configs(problem, template)
            ranked[template] = cfgs
            for tag, why in rejected.items():
                skipped[template if tag == "*" else f"{template}_{problem.dtype}_{tag}"] = why
        limit = sum(len(v) for v in ranked.values()) if space == "exhaustive" else self.max_configs
        # the name filters apply before the limit: KERNELS_ONLY=cutlass2x builds the best sm80 kernels, not the sm80
        # ones among the best of both
        keep = name_filter(config.only, config.skip)
        result = []
        for template, cfg in select(problem, ranked, 10**9):
            choice = Choice("cutlass", template, problem.dtype, None, cfg.params())
            if not keep(choice.name):
                skipped[choice.name] = NAME_FILTERED
            else:
                result.append((template, cfg))
        kept = {t: [c for tt, c in result if tt == t] for t in ranked}
        for template in ranked:     # after the name filters: KERNELS_ONLY=cutlass2x still gets sm80 kernels on sm90
            why_not = superseded(problem, template, kept)
            if why_not and kept[template]:
                skipped[template] = why_not
                kept[template] = []
                result = [(t, c) for t, c in result if t != template]
        picked = select(problem, kept, limit)
        chosen = [Choice("cutlass", t, problem.dtype, None, c.params()) for t, c in picked]
        names = {c.name for c in chosen}
        below = [n for n in (Choice("cutlass", t, problem.dtype, None, c.params()).name for t, c in result)
                 if n not in names]
        if below:   # one line for the lot: dozens of "ranked below" rows would bury the real failures
            skipped["cutlass (ranked cut)"] = (f"{len(below)} more candidates ranked below the {limit} built per "
                                               f"problem (CUTLASS_MAX_CONFIGS), e.g. {', '.join(below[:3])}")
        return chosen, skipped

    def build(self, problem, choices):
        """Load each choice's binary; one the artifact store lacks is compiled here (KERNELS_CUTLASS_BUILD=inline),
        handed back pending for a background build (`background`), or reported not built (`off`)."""
        mode = config.cutlass_build
        binaries = (self._build_binaries(problem, choices) if mode == "inline"
                    else self._built_binaries(problem, choices, mode))
        return [outcome if paths is None else self._load(problem, outcome.choice, paths, started, outcome.compiled)
                for outcome, paths, started in binaries]

    def compile_only(self, problem: GemmProblem, choices: list[Choice]) -> list[BuildOutcome]:
        """Render and build the binaries without loading or running them: what a machine without a GPU can check.
        An outcome with neither runner nor error is a binary that built (or was already in the artifact store)."""
        return [outcome for outcome, _, _ in self._build_binaries(problem, choices)]

    def built(self, problem, choices):
        return {c.name for c in choices if self.state(problem, c) == "built"}

    def settled(self, problem, choices):
        # outside background mode nothing builds them behind the tune's back: a re-tune compiles them (inline) or
        # reports them not built (off)
        return config.cutlass_build != "background" or all(self.state(problem, c) != "missing" for c in choices)

    def state(self, problem: GemmProblem, choice: Choice) -> str:
        """'built', 'failed' (recorded) or 'missing' (also: does not render), without reading the binary."""
        try:
            key, paths, _ = self.artifact_paths(problem, choice)
        except Exception:  # noqa: BLE001 - a config that does not render is never built
            return "missing"
        return artifact_state(paths, key)

    # -- building ---------------------------------------------------------------------------------------------
    def _own_job(self, p: _Prepared) -> BuildJob:
        """The nvcc run that builds one kernel alone, from its own source to its own binary."""
        return BuildJob(p.paths.source, p.paths.binary, p.paths.log, p.spec.flags, self.tools.cutlass.include_dirs)

    def _compile(self, todo: list[_Prepared], max_jobs: int | None = None, on_progress=None) -> None:
        tools = self.tools
        jobs_n = max_jobs or config.max_jobs
        # choices that differ only in run-time arguments (sm90 swizzle) share one artifact: one edge each
        unique = list({p.paths.binary: p for p in todo}.values())
        # a kernel whose compile failed before is compiled alone: in a unit it would fail its unit mates' compile too
        failed_before, fresh = [], []
        for p in unique:
            (fresh if recorded_failure(p.paths, p.key) is None else failed_before).append(p)
        units = translation_units(fresh, jobs_n) + [[p] for p in failed_before]
        units_dir = self.root / "batches" / "units"
        for stale in (*units_dir.glob("*.so"), *units_dir.glob("*.tmp")):    # a killed build's leftovers (the lock is
            with contextlib.suppress(OSError):                                # held: no build of ours is running)
                stale.unlink()
        jobs, shared = [], []
        for members in units:
            if len(members) == 1:
                jobs.append(self._own_job(members[0]))
                continue
            text = batch_source([(p.source, symbol_suffix(p.key)) for p in members])
            stem = units_dir / hashlib.sha256(text.encode()).hexdigest()[:16]
            write_if_different(stem.with_suffix(".cu"), text)
            job = BuildJob(stem.with_suffix(".cu"), stem.with_suffix(".so"), stem.with_suffix(".log"),
                           members[0].spec.flags, tools.cutlass.include_dirs)
            jobs.append(job)
            shared.append((job, members))
        kernels = len(unique)
        # ninja counts compiles; the caller counts kernels (a unit's share of them as it finishes)
        per_kernel = None if on_progress is None else (
            lambda done, total: on_progress(done * kernels // max(1, total), kernels))
        run_ninja(str(tools.nvcc), jobs, self.root / "batches", jobs_n, per_kernel)
        # each member's binary is the unit's (a hard link: one file on disk); a unit that failed, or a member whose
        # binary could not be placed, is compiled again one kernel at a time: one config that does not compile
        # never costs the others theirs
        retry = []
        for job, members in shared:
            if not job.output.exists():
                retry += members
                continue
            for p in members:
                try:
                    _place_binary(job.output, p.paths.binary, job.log, p.paths.log)
                except OSError:
                    retry.append(p)
            for leftover in (job.output, job.source, job.log):
                with contextlib.suppress(OSError):
                    leftover.unlink()
        if retry:
            run_ninja(str(tools.nvcc), [self._own_job(p) for p in retry], self.root / "batches", jobs_n)
        bump_stat("compiles", len(todo))

    def prebuild(self, work: list[tuple[GemmProblem, list[Choice]]], max_jobs: int | None = None,
                 on_progress=None, retry_failed: bool = True) -> int:
        """Every problem's missing binaries in one ninja batch: a problem has a handful of candidates, so
        per-problem builds leave most cores idle (bench.compare builds a whole suite this way first; warmup and the
        background build too). `max_jobs`: parallel compiles (default MAX_JOBS); `on_progress(done, total)` as
        each finishes; `retry_failed=False` leaves out binaries whose compile failed before. Returns how many
        were compiled."""
        pending = []
        checked: dict[Path, bool] = {}

        def built_once(paths: ArtifactPaths, key: str) -> bool:
            # each binary hashed once: hundreds of candidates share a few binaries (528 and 23 for a 32-problem
            # list), and hashing per candidate was most of a tune run's 0.9 s check with everything built (2xH200);
            # a marker's claim alone would leave a corrupt binary to every later tune (the background builder too)
            if paths.binary not in checked:
                checked[paths.binary] = artifact_valid(paths, key)
            return checked[paths.binary]

        for problem, choices in work:
            for choice in choices:
                prepared, _ = self._prepare(len(pending), problem, choice, built=built_once)
                if prepared is not None and (retry_failed or recorded_failure(prepared.paths, prepared.key) is None):
                    pending.append(prepared)
        unique = list({p.paths.binary: p for p in pending}.values())
        return len(self._compile_pending(unique, max_jobs, on_progress)) if unique else 0

    def _prepare(self, index: int, problem, choice, built=None) -> tuple[_Prepared | None, tuple | None]:
        """(what to compile, None), or (None, the result: an outcome and the binary's paths when it exists).
        `built(paths, key)`: whether the binary is there (default artifact_valid: its hash checked)."""
        start = time.perf_counter()
        try:
            key, paths, source = self.artifact_paths(problem, choice)
            spec = spec_for(problem, choice)
        except Exception as e:  # noqa: BLE001 - a config that does not render is one failed candidate
            return None, (BuildOutcome(choice, None, f"render failed: {type(e).__name__}: {e}",
                                       environment=isinstance(e, OSError)), None, start)
        if (built or artifact_valid)(paths, key):
            return None, (BuildOutcome(choice, None), paths, start)
        write_if_different(paths.source, source)
        return _Prepared(index, choice, spec, key, paths, start, source), None

    def _compile_pending(self, pending: list[_Prepared], max_jobs: int | None = None,
                         on_progress=None) -> dict[int, tuple]:
        """Compile what is still missing under the build lock (another process may have built some while we
        waited for it) and publish the good binaries; returns index -> result for what was compiled here."""
        with file_lock(self.root / "build.lock"):
            todo = [p for p in pending if not artifact_valid(p.paths, p.key)]
            if todo:
                self._compile(todo, max_jobs, on_progress)
            return {p.index: self._finish(p) for p in todo}

    def _prepared_all(self, problem, choices) -> tuple[list, list[_Prepared]]:
        """Per choice its result when nothing is to compile (else None), and what is to compile."""
        results: list = [None] * len(choices)
        pending: list[_Prepared] = []
        for i, choice in enumerate(choices):
            prepared, result = self._prepare(i, problem, choice)
            if prepared is None:
                results[i] = result
            else:
                pending.append(prepared)
        return results, pending

    def _build_binaries(self, problem, choices) -> list[tuple[BuildOutcome, ArtifactPaths | None, float]]:
        """Per choice: (an outcome without a runner, the binary's paths when it exists, when its build started).
        Renders every choice, then compiles what the artifact store lacks in one ninja batch under the build lock."""
        results, pending = self._prepared_all(problem, choices)
        if pending:
            compiled = self._compile_pending(pending)
            for p in pending:
                results[p.index] = compiled.get(p.index, (BuildOutcome(p.choice, None), p.paths, p.start))
        return results

    def _built_binaries(self, problem, choices, mode: str) -> list[tuple[BuildOutcome, ArtifactPaths | None, float]]:
        """As _build_binaries, compiling nothing: a missing binary is pending (mode 'background') or not built
        ('off'); one whose compile failed before is that failure."""
        results, missing = self._prepared_all(problem, choices)
        for p in missing:
            failure = recorded_failure(p.paths, p.key)
            if failure is not None:
                outcome = BuildOutcome(p.choice, None, f"compile failed in an earlier build, not retried in "
                                                       f"KERNELS_CUTLASS_BUILD={mode} (`python -m kernels warmup "
                                                       f"--retry-failed` retries; log {p.paths.log}): {failure}")
            elif mode == "background":
                outcome = BuildOutcome(p.choice, None, "pending: not built yet, left to the background build "
                                                       "(KERNELS_CUTLASS_BUILD=background)", pending=True)
            else:
                outcome = BuildOutcome(p.choice, None, "not built, and KERNELS_CUTLASS_BUILD=off (`python -m "
                                                       "kernels warmup` builds the default set)")
            results[p.index] = (outcome, None, p.start)
        return results

    def _finish(self, p: _Prepared) -> tuple[BuildOutcome, ArtifactPaths | None, float]:
        """After ninja: the compile error (with the log's tail, also recorded in failed.json), or the marker
        published for a good binary."""
        if not p.paths.binary.exists():
            try:
                tail = read_tail(p.paths.log, 4 * LOG_TAIL_CHARS).decode(errors="replace")[-LOG_TAIL_CHARS:]
            except OSError:
                tail = "(no compiler log)"
            record_failure(p.paths, p.key, tail.strip())
            return (BuildOutcome(p.choice, None, f"compile failed: {tail.strip()} (source {p.paths.source}, "
                                                 f"log {p.paths.log})", compiled=True,
                                 seconds=time.perf_counter() - p.start), None, p.start)
        publish_marker(p.paths, p.key, {"choice": p.choice.name, "arch": p.spec.arch, "flags": list(p.spec.flags),
                                        "nvcc": self.tools.nvcc_version, "cutlass": self.tools.cutlass.version})
        return BuildOutcome(p.choice, None, compiled=True, seconds=time.perf_counter() - p.start), p.paths, p.start

    def _load(self, problem, choice, paths: ArtifactPaths, start: float, compiled: bool) -> BuildOutcome:
        try:
            kernel = self._libraries.get(paths.binary)
            if kernel is None:
                kernel = load_library(paths.binary, problem.epilogue_operands, symbol_suffix(paths.root.name))
                self._libraries[paths.binary] = kernel
            if not compiled:
                bump_stat("artifact_loads")
            launch = make_launcher(kernel, problem, CutlassConfig.from_params(choice.params))
        except Exception as e:  # noqa: BLE001
            return BuildOutcome(choice, None, f"load failed: {type(e).__name__}: {str(e)[:300]} (binary "
                                              f"{paths.binary})", compiled=compiled)
        return BuildOutcome(choice, Runner(choice, launch, isolated=self.isolated), compiled=compiled,
                            seconds=time.perf_counter() - start)


def create() -> CutlassBackend:
    return CutlassBackend()


__all__ = ["CutlassBackend", "CutlassLaunchError", "create"]
