"""CUTLASS backend: render one .cu per config, build a batch with one `ninja -jN`, load the .so with ctypes and
launch on torch's current stream. Runners are isolated (CutlassBackend.isolated): verification and timing
run in a child process (backends/isolated_child.py), so a faulting kernel cannot poison the caller's CUDA context.

Artifacts: <cache_dir>/cutlass/sm<arch>/<key>/{kernel.cu, kernel.so, build.log, meta.json}; key = source hash +
nvcc version + flags + arch + CUTLASS version. `meta.json` is written last and records the binary's size and hash:
an entry without a matching marker is a miss and is rebuilt.
"""
from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from backends.base import Backend, BuildOutcome, Runner
from backends.cutlass_render import BuildJob, CutlassKernelSpec, build_key, ninja_text, render, spec_for
from kernels.core.cache_root import cache_root
from kernels.core.choice import Choice, name_filter
from kernels.core.config import config
from kernels.core.counters import bump as bump_stat
from kernels.core.errors import BuildError, KernelsError
from kernels.core.fsutil import file_lock, marker_valid, write_if_different
from kernels.core.fsutil import publish_marker as fs_publish_marker
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.core.toolchain import Toolchain, toolchain
from kernels.space.heuristics_cutlass import (
    SM80_TEMPLATES,
    SM90_TEMPLATES,
    CutlassConfig,
    kernel_operands,
    ranked_configs,
    select,
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


def publish_marker(paths: ArtifactPaths, key: str, info: dict) -> None:
    fs_publish_marker(paths.binary, paths.marker, key, info)


def artifact_valid(paths: ArtifactPaths, key: str) -> bool:
    return marker_valid(paths.binary, paths.marker, key)


# -- loading and launching ----------------------------------------------------------------------------------------
@dataclass
class LoadedKernel:
    workspace_size: object       # ctypes function
    run: object


def load_library(path: Path) -> LoadedKernel:
    lib = ctypes.CDLL(str(path))
    ws = lib.kernels_cutlass_workspace_size
    ws.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]
    ws.restype = ctypes.c_int
    run = lib.kernels_cutlass_run
    run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
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


def make_launcher(kernel: LoadedKernel, problem: GemmProblem, cfg: CutlassConfig):
    """launch(a, b, out) for one problem: kernel-coordinate M/N, operand order and leading dims fixed up front."""
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

    def launch(a, b, out=None):
        if out is not None and _needs_staging(out, problem.n, cfg.align_c):
            out.copy_(launch(a, b, None))
            return out
        device = a.device
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
        ws = torch.empty(ws_bytes, dtype=torch.uint8, device=device) if ws_bytes else None
        ptrs = {"a": a.data_ptr(), "b": b.data_ptr()}
        ldc = out.stride(0) if out.shape[0] > 1 else problem.n
        status = run(ptrs[first], ptrs[second], out.data_ptr(), m, n, k, lda, ldb, ldc,
                     ws.data_ptr() if ws is not None else None, swizzle, raw_stream(device.index))
        if status != 0:
            raise CutlassLaunchError(f"cutlass::Status {status} from {cfg.tag()} on {problem.short()}")
        return out

    return launch


def run_ninja(nvcc: str, jobs: list[BuildJob], batches_dir: Path, max_jobs: int) -> None:
    """Build every job with one `ninja -jN`, keeping going past failures: a job succeeded iff its output exists."""
    text = ninja_text(nvcc, jobs)
    batch = batches_dir / hashlib.sha256(text.encode()).hexdigest()[:16]
    write_if_different(batch / "build.ninja", text)
    for job in jobs:
        job.log.parent.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["ninja", "-C", str(batch), "-k", "0", f"-j{max_jobs}"], capture_output=True, text=True,
                       check=False)
    except OSError as e:
        raise BuildError(f"could not run ninja: {e}") from e


# -- the backend --------------------------------------------------------------------------------------------------
@dataclass
class _Prepared:
    index: int
    choice: Choice
    spec: CutlassKernelSpec
    key: str
    paths: ArtifactPaths
    start: float


class CutlassBackend(Backend):
    name = "cutlass"
    isolated = True

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
        for template in (SM90_TEMPLATES[problem.op], SM80_TEMPLATES[problem.op]):
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
                skipped[choice.name] = "left out by KERNELS_ONLY / KERNELS_SKIP"
            else:
                result.append((template, cfg))
        picked = select(problem, {t: [c for tt, c in result if tt == t] for t in ranked}, limit)
        chosen = [Choice("cutlass", t, problem.dtype, None, c.params()) for t, c in picked]
        names = {c.name for c in chosen}
        below = [n for n in (Choice("cutlass", t, problem.dtype, None, c.params()).name for t, c in result)
                 if n not in names]
        if below:   # one line for the lot: dozens of "ranked below" rows would bury the real failures
            skipped["cutlass (ranked cut)"] = (f"{len(below)} more candidates ranked below the {limit} built per "
                                               f"problem (CUTLASS_MAX_CONFIGS), e.g. {', '.join(below[:3])}")
        return chosen, skipped

    def build(self, problem, choices):
        return [outcome if paths is None else self._load(problem, outcome.choice, paths, started, outcome.compiled)
                for outcome, paths, started in self._build_binaries(problem, choices)]

    def compile_only(self, problem: GemmProblem, choices: list[Choice]) -> list[BuildOutcome]:
        """Render and build the binaries without loading or running them: what a machine without a GPU can check.
        An outcome with neither runner nor error is a binary that built (or was already in the artifact store)."""
        return [outcome for outcome, _, _ in self._build_binaries(problem, choices)]

    # -- building ---------------------------------------------------------------------------------------------
    def _compile(self, todo: list[_Prepared]) -> None:
        tools = self.tools
        # choices that differ only in run-time arguments (sm90 swizzle) share one artifact: one edge each
        unique = {p.paths.binary: p for p in todo}.values()
        jobs = [BuildJob(p.paths.source, p.paths.binary, p.paths.log, p.spec.flags, tools.cutlass.include_dirs)
                for p in unique]
        run_ninja(str(tools.nvcc), jobs, self.root / "batches", config.max_jobs)
        bump_stat("compiles", len(todo))

    def prebuild(self, work: list[tuple[GemmProblem, list[Choice]]]) -> int:
        """Every problem's missing binaries in one ninja batch: a problem has a handful of candidates, so
        per-problem builds leave most cores idle (bench.compare builds a whole suite this way first)."""
        pending = []
        for problem, choices in work:
            for choice in choices:
                prepared, _ = self._prepare(len(pending), problem, choice)
                if prepared is not None:
                    pending.append(prepared)
        unique = list({p.paths.binary: p for p in pending}.values())
        return len(self._compile_pending(unique)) if unique else 0

    def _prepare(self, index: int, problem, choice) -> tuple[_Prepared | None, tuple | None]:
        """(what to compile, None), or (None, the result: an outcome and the binary's paths when it exists)."""
        start = time.perf_counter()
        try:
            key, paths, source = self.artifact_paths(problem, choice)
            spec = spec_for(problem, choice)
        except Exception as e:  # noqa: BLE001 - a config that does not render is one failed candidate
            return None, (BuildOutcome(choice, None, f"render failed: {type(e).__name__}: {e}"), None, start)
        if artifact_valid(paths, key):
            return None, (BuildOutcome(choice, None), paths, start)
        write_if_different(paths.source, source)
        return _Prepared(index, choice, spec, key, paths, start), None

    def _compile_pending(self, pending: list[_Prepared]) -> dict[int, tuple]:
        """Compile what is still missing under the build lock (another process may have built some while we
        waited for it) and publish the good binaries; returns index -> result for what was compiled here."""
        with file_lock(self.root / "build.lock"):
            todo = [p for p in pending if not artifact_valid(p.paths, p.key)]
            if todo:
                self._compile(todo)
            return {p.index: self._finish(p) for p in todo}

    def _build_binaries(self, problem, choices) -> list[tuple[BuildOutcome, ArtifactPaths | None, float]]:
        """Per choice: (an outcome without a runner, the binary's paths when it exists, when its build started).
        Renders every choice, then compiles what the artifact store lacks in one ninja batch under the build lock."""
        results: list = [None] * len(choices)
        pending: list[_Prepared] = []
        for i, choice in enumerate(choices):
            prepared, result = self._prepare(i, problem, choice)
            if prepared is None:
                results[i] = result
            else:
                pending.append(prepared)
        if pending:
            compiled = self._compile_pending(pending)
            for p in pending:
                results[p.index] = compiled.get(p.index, (BuildOutcome(p.choice, None), p.paths, p.start))
        return results

    def _finish(self, p: _Prepared) -> tuple[BuildOutcome, ArtifactPaths | None, float]:
        """After ninja: the compile error (with the log's tail), or the marker published for a good binary."""
        if not p.paths.binary.exists():
            try:
                tail = p.paths.log.read_text()[-LOG_TAIL_CHARS:]
            except OSError:
                tail = "(no compiler log)"
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
                kernel = load_library(paths.binary)
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
