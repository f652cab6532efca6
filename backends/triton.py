"""Triton backend: render templates, compile in worker processes (no GPU there), load and launch in the caller.

With TRITON_INTERPRET=1 the same rendered kernels run through Triton's interpreter on CPU tensors.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from pathlib import Path

import torch

from backends.base import Backend, BuildOutcome, Runner
from backends.triton_worker import compile_job, load_kernel
from backends.triton_render import (TEMPLATE_FILES, TritonKernelSpec, build_key, render, spec_for)
from backends.worker_pool import WorkerPool, worker_env
from kernels import counters
from kernels.choice import Choice
from kernels.config import config, interpret_mode
from kernels.fsutil import atomic_write_text, read_json, write_if_different
from kernels.heuristics import candidate_configs
from kernels.problem import DTYPES_BY_NAME, GemmProblem

TEMPLATES_BY_OP = {"mm": ("triton_mm",), "int_mm": ("triton_int8_mm",)}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1)
def triton_version() -> str:
    import triton

    return triton.__version__


class TritonBackend(Backend):
    name = "triton"

    def __init__(self):
        self._pool: WorkerPool | None = None
        self._pool_key = None
        self._kernels: dict[tuple, object] = {}   # (build key, device) -> loaded CompiledKernel

    # -- paths -------------------------------------------------------------------------------------------------
    @property
    def root(self) -> Path:
        return Path(config.cache_dir) / "triton"

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
        if problem.device == "cuda" and interpret_mode():
            return False, "TRITON_INTERPRET=1 is set: Triton runs only on CPU tensors in this process"
        if problem.device == "cuda" and problem.arch < 75:
            return False, f"compute capability {problem.arch} is older than Triton supports here"
        return True, ""

    def choices(self, problem, space="default"):
        result: list[Choice] = []
        for template in TEMPLATES_BY_OP[problem.op]:
            for cfg in candidate_configs(problem, template, space):
                result.append(Choice("triton", template, problem.dtype, cfg))
        return result, {}

    def build(self, problem, choices):
        prepared = []
        for choice in choices:
            start = time.perf_counter()
            try:
                spec = spec_for(problem, choice)
                source = render(spec)
                module_path = self.root / "src" / f"{choice.template}_{_digest(source)}.py"
                write_if_different(module_path, source)
                prepared.append((choice, spec, module_path, source, start, None))
            except Exception as e:  # noqa: BLE001 - a template that does not render is one failed candidate
                prepared.append((choice, None, None, None, start, f"render failed: {type(e).__name__}: {e}"))
        if interpret_mode():
            return [self._interpreted(problem, *p) for p in prepared]
        return self._compiled(problem, prepared)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # -- interpreter -------------------------------------------------------------------------------------------
    def _interpreted(self, problem, choice, spec, module_path, source, start, error) -> BuildOutcome:
        if error:
            return BuildOutcome(choice, None, error)
        try:
            fn = load_kernel(str(module_path), spec.kernel_name)
        except Exception as e:  # noqa: BLE001
            return BuildOutcome(choice, None, f"import failed: {type(e).__name__}: {e} (source {module_path})")
        return BuildOutcome(choice, Runner(choice, _interpreted_launcher(fn, problem, spec)),
                            seconds=time.perf_counter() - start)

    # -- compiled ----------------------------------------------------------------------------------------------
    def _job(self, problem: GemmProblem, spec: TritonKernelSpec, module_path: Path) -> dict:
        return {"module_path": str(module_path), "kernel_name": spec.kernel_name, "signature": spec.signature,
                "div16": list(spec.div16), "backend": "cuda", "arch": problem.arch, "warp_size": 32,
                "options": spec.options}

    def _compiled(self, problem, prepared) -> list[BuildOutcome]:
        outcomes: dict[int, BuildOutcome] = {}
        to_compile = []
        for i, (choice, spec, module_path, source, start, error) in enumerate(prepared):
            if error:
                outcomes[i] = BuildOutcome(choice, None, error)
                continue
            key = build_key(source, spec, f"cuda:{problem.arch}", triton_version())
            marker = self.root / "artifacts" / f"{key}.json"
            meta = read_json(marker)
            if meta is not None and self._in_triton_cache(meta.get("cache_group", "")):
                outcomes[i] = self._load(problem, choice, spec, module_path, key, start, compiled=False)
            else:
                job = self._job(problem, spec, module_path)
                job["id"] = i
                to_compile.append((i, key, marker, job))
        if to_compile:
            results = self._get_pool().map([job for _, _, _, job in to_compile])
            counters.bump("compiles", len(to_compile))
            for (i, key, marker, job), res in zip(to_compile, results):
                choice, spec, module_path, _, start, _ = prepared[i]
                if not res.get("ok"):
                    log = self.root / "logs" / f"{key}.log"
                    atomic_write_text(log, f"{job}\n\n{res.get('trace') or res.get('error')}\n")
                    outcomes[i] = BuildOutcome(choice, None, f"compile failed: {res.get('error', '?')[-300:]} "
                                                             f"(source {module_path}, log {log})", compiled=True)
                    continue
                atomic_write_text(marker, _json({"choice": choice.name, "triton_hash": res["hash"],
                                                 "cache_group": res["cache_group"],
                                                 "triton": triton_version(), "arch": problem.arch,
                                                 "compile_seconds": res.get("seconds")}))
                outcomes[i] = self._load(problem, choice, spec, module_path, key, start, compiled=True)
        return [outcomes[i] for i in range(len(prepared))]

    def _in_triton_cache(self, group: str) -> bool:
        """The compiled kernel's files are still in Triton's cache (its metadata JSON is written last)."""
        return bool(group) and any((self.triton_cache_dir / group).glob("*.json"))

    def _load(self, problem, choice, spec, module_path, key, start, compiled) -> BuildOutcome:
        try:
            # loaded once per device: a CUDA function handle belongs to the context it was loaded in
            loaded_key = (key, torch.cuda.current_device())
            kernel = self._kernels.get(loaded_key)
            if kernel is None:
                with _triton_cache_at(self.triton_cache_dir):
                    kernel = compile_job(self._job(problem, spec, module_path))
                    kernel._init_handles()      # loads the cubin; raises when resources do not fit the device
                self._kernels[loaded_key] = kernel
            if not compiled:
                counters.bump("artifact_loads")
            launch = _compiled_launcher(kernel, problem, spec)
        except Exception as e:  # noqa: BLE001
            return BuildOutcome(choice, None, f"load failed: {type(e).__name__}: {str(e)[:300]}", compiled=compiled)
        return BuildOutcome(choice, Runner(choice, launch), compiled=compiled, seconds=time.perf_counter() - start)

    def _get_pool(self) -> WorkerPool:
        key = (str(self.triton_cache_dir), config.max_jobs)
        if self._pool is None or self._pool_key != key:
            self.close()
            env = worker_env({"TRITON_CACHE_DIR": str(self.triton_cache_dir), "CUDA_VISIBLE_DEVICES": ""},
                             drop=("TRITON_INTERPRET",))
            self._pool = WorkerPool("backends.triton_worker", env, config.max_jobs)
            self._pool_key = key
        return self._pool


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _json(obj) -> str:
    import json

    return json.dumps(obj, sort_keys=True, indent=1)


@contextlib.contextmanager
def _triton_cache_at(path: Path):
    """Point Triton's cache at ours for one compile call, leaving the user's setting as it was."""
    import triton

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


def _output_factory(problem: GemmProblem):
    shape, dtype = (problem.m, problem.n), DTYPES_BY_NAME[problem.out_dtype]
    return shape, dtype


def _needs_staging(out: torch.Tensor) -> bool:
    """Kernels write row-major, 16-byte aligned outputs; any other `out` gets a staging buffer and a copy."""
    return (out.stride(1) != 1 and out.shape[1] != 1) or out.data_ptr() % 16 != 0


def _compiled_launcher(kernel, problem: GemmProblem, spec: TritonKernelSpec):
    import triton

    knobs = getattr(triton, "knobs", None)
    hooks = knobs is not None and (knobs.runtime.launch_enter_hook or knobs.runtime.launch_exit_hook)
    m, n, k = problem.m, problem.n, problem.k
    sa0, sa1 = problem.stride_a
    sb0, sb1 = problem.stride_b
    grid = _cdiv(m, spec.block_m) * _cdiv(n, spec.block_n)
    shape, dtype = _output_factory(problem)
    device = torch.device("cuda", torch.cuda.current_device())
    raw_stream = torch._C._cuda_getCurrentRawStream
    dev_index = device.index
    if hooks:   # a profiler hook is installed: take Triton's own (slower) path so it sees the launch
        def run(a, b, out, ldc):
            kernel[(grid, 1, 1)](a, b, out, m, n, k, sa0, sa1, sb0, sb1, ldc, 1)
    else:
        direct = _direct_launch(kernel)
        function, packed = kernel.function, kernel.packed_metadata
        if direct is not None:
            c_launch, coop, pdl = direct

            def run(a, b, out, ldc):
                c_launch(grid, 1, 1, raw_stream(dev_index), function, coop, pdl, None, None, packed, None, None,
                         None, a, b, out, m, n, k, sa0, sa1, sb0, sb1, ldc, 1)
        else:
            fast_run = kernel.run

            def run(a, b, out, ldc):
                fast_run(grid, 1, 1, raw_stream(dev_index), function, packed, None, None, None,
                         a, b, out, m, n, k, sa0, sa1, sb0, sb1, ldc, 1)

    # the binary assumed N % 16 == 0 for the output's row stride only when it was true of the problem
    def launch(a, b, out=None):
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=device)
            run(a, b, out, n)
            return out
        if _needs_staging(out) or (10 in spec.div16 and out.stride(0) % 16):
            out.copy_(launch(a, b, None))
            return out
        run(a, b, out, out.stride(0))
        return out

    return launch


def _direct_launch(kernel):
    """The compiled C launch function, called without the Python wrapper (about 1 us less per call), for the
    launcher layout we know (triton 3.5-3.6: launch(grid, stream, function, cooperative, pdl, global_scratch,
    profile_scratch, *rest)) and only when the kernel needs no scratch memory. None means: use kernel.run."""
    import inspect

    launcher = kernel.run
    mod_launch = getattr(launcher, "launch", None)
    try:
        params = list(inspect.signature(type(launcher).__call__).parameters)
    except (TypeError, ValueError):
        return None
    if mod_launch is None or params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]:
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    if getattr(launcher, "num_ctas", 1) != 1:
        return None
    return mod_launch, launcher.launch_cooperative_grid, launcher.launch_pdl


def _interpreted_launcher(fn, problem: GemmProblem, spec: TritonKernelSpec):
    m, n, k = problem.m, problem.n, problem.k
    grid = (_cdiv(m, spec.block_m) * _cdiv(n, spec.block_n),)
    shape, dtype = _output_factory(problem)

    def launch(a, b, out=None):
        if out is not None and _needs_staging(out):
            out.copy_(launch(a, b, None))
            return out
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=a.device)
        fn[grid](a, b, out, m, n, k, *a.stride(), *b.stride(), out.stride(0), 1)
        return out

    return launch


def create() -> TritonBackend:
    return TritonBackend()


__all__ = ["TritonBackend", "TEMPLATE_FILES", "create"]
