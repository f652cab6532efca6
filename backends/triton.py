"""Triton backend: render templates, compile in worker processes (no GPU there), load and launch in the caller.

With TRITON_INTERPRET=1 the same rendered kernels run through Triton's interpreter on CPU tensors.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch

from backends.base import Backend, BuildOutcome, Runner
from backends.triton_launch import CompiledHandle, InterpretedHandle
from backends.triton_modules import module_file_name
from backends.triton_modules import publish as publish_module
from backends.triton_render import TritonKernelSpec, build_key, render
from backends.triton_templates import family, templates
from backends.triton_worker import compile_job, load_cached, load_kernel
from backends.worker_pool import WorkerPool, worker_env
from kernels.core import counters
from kernels.core.cache_root import cache_root, refuse_foreign
from kernels.core.choice import Choice
from kernels.core.config import config, interpret_mode
from kernels.core.fsutil import atomic_write_text, build_each_once, file_sha256, make_private_dirs, read_json
from kernels.core.problem import GemmProblem
from kernels.space.families import TEMPLATE_OPS


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    import triton

    return triton.__version__


class TritonBackend(Backend):
    name = "triton"
    epilogues = True     # every mm family applies bias + activation in its kernel (templates/triton/_gemm.jinja)

    def __init__(self):
        self._pool: WorkerPool | None = None
        self._pool_key = None
        self._kernels: dict[tuple, object] = {}   # (build key, device) -> loaded CompiledKernel

    # -- paths -------------------------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return cache_root() / "triton"

    @property
    def triton_cache_dir(self) -> Path:
        return self.root / "triton_cache"

    # -- Backend -----------------------------------------------------------------------------------------------
    def available(self, problem: GemmProblem) -> tuple[bool, str]:
        try:
            import triton  # noqa: F401
        except ImportError as e:
            return False, f"triton is not installed: {e}"
        if problem.device == "cpu" and not interpret_mode():
            return False, "CPU tensors need TRITON_INTERPRET=1 for Triton"
        if problem.device == "cpu" and importlib.util.find_spec("numpy") is None:
            return False, "the Triton interpreter needs numpy (pip install numpy)"
        if problem.device == "cuda" and interpret_mode():
            return False, "TRITON_INTERPRET=1 is set: Triton runs only on CPU tensors in this process"
        if problem.device == "cuda" and problem.arch < 75:
            return False, f"compute capability {problem.arch} is older than Triton supports here"
        return True, ""

    def choices(self, problem, space="default"):
        result: list[Choice] = []
        skipped: dict[str, str] = {}
        for template in templates():
            if problem.op in TEMPLATE_OPS.get(template, ()):
                cands, left_out = family(template).choices(problem, template, space)
                result.extend(cands)
                skipped.update(left_out)
        return result, skipped

    def build(self, problem, choices):
        """Render every kernel the choices need, compile the distinct ones in parallel, then assemble launchers."""
        plans: list[tuple[Choice, list[TritonKernelSpec], list[str], float, str | None]] = []
        kernels: dict[str, tuple[TritonKernelSpec, Path, str]] = {}    # build key -> (spec, module, source)
        environment: set[str] = set()      # choices whose module could not be written (BuildOutcome.environment)
        for choice in choices:
            start = time.perf_counter()
            try:
                specs = family(choice.template).specs(problem, choice)
                keys = []
                for spec in specs:
                    source = render(spec)
                    key = build_key(source, spec, f"cuda:{problem.arch}", triton_version())
                    if key not in kernels:
                        path = self.root / "src" / module_file_name(spec.template_file.split('.')[0], source)
                        publish_module(path, source, atomic_write_text)
                        kernels[key] = (spec, path, source)
                    keys.append(key)
                plans.append((choice, specs, keys, start, None))
            except Exception as e:  # noqa: BLE001 - a template that does not render is one failed candidate
                plans.append((choice, [], [], start, f"render failed: {type(e).__name__}: {e}"))
                if isinstance(e, OSError):
                    environment.add(choice.name)
        if interpret_mode():
            handles, compiled_now = self._interpreted(kernels), set()
        else:
            handles, compiled_now = self._compiled(problem, kernels)
        outcomes = []
        for choice, specs, keys, start, error in plans:
            compiled = any(k in compiled_now for k in keys)
            if error is None:
                error = next((handles[k] for k in keys if isinstance(handles[k], str)), None)
            if error is not None:
                outcomes.append(BuildOutcome(choice, None, error, compiled=compiled,
                                             environment=choice.name in environment))
                continue
            try:
                launch = family(choice.template).launcher(problem, choice, specs, [handles[k] for k in keys])
            except Exception as e:  # noqa: BLE001
                outcomes.append(BuildOutcome(choice, None, f"launcher failed: {type(e).__name__}: {str(e)[:300]}"))
                continue
            outcomes.append(BuildOutcome(choice, Runner(choice, launch, isolated=self.isolated),
                                         compiled=compiled, seconds=time.perf_counter() - start))
        return outcomes

    def built(self, problem, choices):
        if interpret_mode():
            return set()
        names = set()
        for choice in choices:
            try:
                specs = family(choice.template).specs(problem, choice)
                keys = [build_key(render(spec), spec, f"cuda:{problem.arch}", triton_version()) for spec in specs]
            except Exception:  # noqa: BLE001 - a choice that does not render is not built
                continue
            if keys and all(self._stored(key, spec, problem.arch) for key, spec in zip(keys, specs)):
                names.add(choice.name)
        return names

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- interpreter -------------------------------------------------------------------------------------------
    def _interpreted(self, kernels) -> dict[str, object]:
        """build key -> InterpretedHandle, or the failure text."""
        handles: dict[str, object] = {}
        for key, (spec, path, _) in kernels.items():
            try:
                handles[key] = InterpretedHandle(load_kernel(str(path), spec.kernel_name))
            except Exception as e:  # noqa: BLE001
                handles[key] = f"import failed: {type(e).__name__}: {e} (source {path})"
        return handles

    # -- compiled ----------------------------------------------------------------------------------------------
    def _job(self, problem: GemmProblem, spec: TritonKernelSpec, module_path: Path) -> dict:
        return {"module_path": str(module_path), "kernel_name": spec.kernel_name, "signature": spec.signature,
                "div16": list(spec.div16), "backend": "cuda", "arch": problem.arch, "warp_size": 32,
                "options": spec.options}

    def _compiled(self, problem, kernels) -> tuple[dict[str, object], set[str]]:
        """(build key -> CompiledHandle or the failure text, the keys compiled now). Compiles what the artifact store
        lacks, in parallel; a kernel another process is compiling at the same time (a tuning worker on the host's
        other GPU) is waited for rather than compiled twice."""
        handles: dict[str, object] = {}
        missing = [key for key, (spec, _, _) in kernels.items() if not self._stored(key, spec, problem.arch)]

        def compile_these(keys: list[str]) -> None:
            jobs = []
            for key in keys:
                spec, path, _ = kernels[key]
                self._drop_changed_group(key, spec, problem.arch)
                jobs.append(dict(self._job(problem, spec, path), id=len(jobs)))
            results = self._get_pool().map(jobs)
            counters.bump("compiles", len(jobs))
            for key, job, res in zip(keys, jobs, results):
                if res.get("ok"):
                    atomic_write_text(self.root / "artifacts" / f"{key}.json",
                                      _json({"kernel": job["kernel_name"], "triton_hash": res["hash"],
                                             "cache_group": res["cache_group"], "triton": triton_version(),
                                             "arch": problem.arch, "compile_seconds": res.get("seconds"),
                                             "files": self._group_hashes(res["cache_group"])}))
                    continue
                log = self.root / "logs" / f"{key}.log"
                atomic_write_text(log, f"{job}\n\n{res.get('trace') or res.get('error')}\n")
                handles[key] = (f"compile failed: {res.get('error', '?')[-300:]} "
                                f"(source {job['module_path']}, log {log})")

        compiled_now: set[str] = set()
        if missing:
            compiled_now = set(build_each_once(
                missing, lambda key: self.root / "locks" / f"{key}.lock",
                lambda key: self._stored(key, kernels[key][0], problem.arch), compile_these))
        for key, (spec, path, _) in kernels.items():
            if key not in handles:
                handles[key] = self._load(problem, spec, path, key, from_store=key not in compiled_now)
        return handles, compiled_now

    def _stored(self, key: str, spec: TritonKernelSpec, arch: int) -> bool:
        """The artifact store has a well-formed record of this kernel under its build key, and the kernel's files
        are still in Triton's cache. A record that is not what this process would have written is a miss (the
        kernel is compiled again and the record rewritten)."""
        meta = read_json(self.root / "artifacts" / f"{key}.json")
        return (meta is not None and _artifact_record_valid(meta, spec.kernel_name, arch)
                and self._group_intact(meta["cache_group"], meta.get("files")))

    def _drop_changed_group(self, key: str, spec: TritonKernelSpec, arch: int) -> None:
        """Before a kernel is compiled again: a record of ours whose cache folder no longer hashes as recorded (it is
        being compiled again, so `_stored` failed) has that folder removed. Triton's cache checks only that a
        folder's files exist, so the pool's compile would hand the changed files back as a hit, and their hashes would
        be recorded as the kernel's. Called under the key's build lock."""
        meta = read_json(self.root / "artifacts" / f"{key}.json")
        if meta is not None and _artifact_record_valid(meta, spec.kernel_name, arch):
            shutil.rmtree(self.triton_cache_dir / meta["cache_group"], ignore_errors=True)

    def _group_hashes(self, group: str) -> dict[str, str]:
        """sha256 of every file of a compiled kernel's folder in Triton's cache (cubin, metadata, IR)."""
        folder = self.triton_cache_dir / group
        return {p.name: file_sha256(p) for p in sorted(folder.iterdir()) if p.is_file()} if folder.is_dir() else {}

    def _group_intact(self, group: str, files) -> bool:
        """Triton loads the binary from its cache folder without a check of its own: the files there must be the
        ones this backend recorded when it compiled them (a truncated or swapped cubin is a miss, compiled again)."""
        if not _files_record_valid(files):
            return False
        folder = self.triton_cache_dir / group
        try:
            return all(file_sha256(folder / name) == digest for name, digest in files.items())
        except OSError:         # missing, or not a regular file (a FIFO is refused, never waited on): compiled again
            return False

    def _load(self, problem, spec, module_path, key, from_store: bool):
        try:
            # loaded once per device: a CUDA function handle belongs to the context it was loaded in
            device = torch.cuda.current_device()
            kernel = self._kernels.get((key, device))
            if kernel is None:
                refuse_foreign(self.triton_cache_dir, "Triton's cache")     # where Triton loads binaries from
                _triton_driver_ready()
                with _triton_cache_at(self.triton_cache_dir):
                    # just compiled or not, through the record: triton.compile's cache hit would first hash Triton's
                    # installation (0.43 s of a process's first call on the H100 host) and each kernel's source
                    kernel = self._from_store(problem, spec, module_path, key)
                    if kernel is None:
                        kernel = compile_job(self._job(problem, spec, module_path))
                    kernel._init_handles()      # loads the cubin; raises when resources do not fit the device
                self._kernels[(key, device)] = kernel
                if from_store:
                    counters.bump("artifact_loads")
            return CompiledHandle(kernel, device, tuple(a.type for a in spec.args))
        except Exception as e:  # noqa: BLE001
            return f"load failed: {type(e).__name__}: {str(e)[:300]}"

    def _from_store(self, problem, spec, module_path, key: str):
        """A kernel straight from its cache folder (what triton.compile's cache hit returns, minus the hash of Triton's
        installation it computes first), or None: then triton.compile finds it. The folder's files are those
        `_stored` checked against the record, or those `_compiled` has just hashed into it (a fresh compile)."""
        meta = read_json(self.root / "artifacts" / f"{key}.json")
        if meta is None or not _artifact_record_valid(meta, spec.kernel_name, problem.arch):
            return None
        files = meta.get("files")
        if not _files_record_valid(files):
            return None         # read again since `_stored`: names must still stay inside the folder
        folder = self.triton_cache_dir / meta["cache_group"]
        for name in files:      # the kernel's binary and metadata, as on disk now: in a folder only this user writes
            refuse_foreign(folder / name, "the Triton kernel file")
        try:
            return load_cached(self._job(problem, spec, module_path), str(folder),
                               list(files), meta["triton_hash"])
        except Exception:  # noqa: BLE001 - another Triton's CompiledKernel: the regular path loads it
            return None

    def _get_pool(self) -> WorkerPool:
        key = (str(self.triton_cache_dir), config.max_jobs)
        if self._pool is None or self._pool_key != key:
            self.close()
            make_private_dirs(self.triton_cache_dir)       # before the workers' Triton makes it under their umask
            env = worker_env({"TRITON_CACHE_DIR": str(self.triton_cache_dir), "CUDA_VISIBLE_DEVICES": ""},
                             drop=("TRITON_INTERPRET",))
            self._pool = WorkerPool("backends.triton_worker", env, config.max_jobs)
            self._pool_key = key
        return self._pool


# what a record's strings may hold: Triton's kernel hash is hex; its cache folder is one plain path component
_HEX = re.compile(r"[0-9a-f]{16,128}")
_CACHE_GROUP = re.compile(r"[A-Za-z0-9_-]{1,128}")
_FILE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


def _artifact_record_valid(meta: dict, kernel_name: str, arch: int) -> bool:
    """`meta` is the record `_compiled` writes for this kernel: right types, this kernel, this Triton and arch, and a
    cache folder name that stays inside Triton's cache."""
    seconds = meta.get("compile_seconds")
    return (meta.get("kernel") == kernel_name and meta.get("triton") == triton_version()
            and type(meta.get("arch")) is int and meta["arch"] == arch
            and isinstance(meta.get("triton_hash"), str) and _HEX.fullmatch(meta["triton_hash"]) is not None
            and isinstance(meta.get("cache_group"), str) and _CACHE_GROUP.fullmatch(meta["cache_group"]) is not None
            and (seconds is None or (type(seconds) in (int, float) and math.isfinite(seconds) and seconds >= 0)))


def _files_record_valid(files) -> bool:
    """A record's `files`: a non-empty name -> sha256 map whose names stay inside the kernel's cache folder."""
    return (isinstance(files, dict) and bool(files)
            and all(isinstance(n, str) and _FILE_NAME.fullmatch(n) and isinstance(h, str) for n, h in files.items()))


def _json(obj) -> str:
    return json.dumps(obj, sort_keys=True, indent=1)


@functools.lru_cache(maxsize=1)
def _triton_driver_ready() -> None:
    """Triton builds and loads its own driver helpers (cuda_utils.so) on first use, into whichever cache directory is
    current: make that Triton's own, not ours, where only our kernels' folders are hash-checked."""
    import triton

    _ = triton.runtime.driver.active.utils


@contextlib.contextmanager
def _triton_cache_at(path: Path):
    """Point Triton's cache at ours for one compile call, leaving the user's setting as it was. The folder is made
    0700 first: Triton's own folders below it follow the umask (kernels.core.cache_root.foreign_writer)."""
    import triton

    make_private_dirs(path)
    knobs = getattr(triton, "knobs", None)
    if knobs is None:   # older triton: the environment variable is read at call time
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = str(path)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = old
        return
    with knobs.cache.scope():
        knobs.cache.dir = str(path)
        yield


def create() -> TritonBackend:
    return TritonBackend()


__all__ = ["TritonBackend", "create"]
