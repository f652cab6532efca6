"""The C++ warm-call table (kernels/native/csrc/fastpath.cpp): built once per torch/Python/source, loaded when its
marker vouches for it.

Why: a warm `kernels.mm` in Python builds a 13-field key from tensor attributes (~1 us here, ~2 us on the H100's
host) before it reaches torch.mm; for host-bound problems that is the whole gap to torch.mm. The C++ table reads the
same fields from the TensorImpls and calls at::mm itself. A warm `kernels.linear` in Python also flattens x, makes
weight.t() and a key with the epilogue (~7-15 us against F.linear's ~4-6 us on this CPU); its C++ entry point
(call_linear) reads the key from x and weight directly and runs aten_addmm winners as at::addmm / at::mm plus the
activation in place, so a warm linear costs about what F.linear does. A warm `kernels.scaled_mm` (fp8) in Python builds
a 21-field key (4-10 us more per call than torch._scaled_mm on the H200's host); call_scaled_mm reads mm's key from a
and b, checks the scales and bias in place and runs at::_scaled_mm or a native Triton launch.

Build: one g++ call ($CXX, default c++) against torch's headers (~15-25 s on 2 cores), into
<cache_dir>/fastpath/<tag>/ (one library per torch/Python/source/compiler), run by a builder process
(kernels.native.fastpath_build) under a lock beside the library: one build at a time, published with os.replace and
a marker written last (size and sha256). A library is loaded only when its marker matches it: one that does not
(truncated, swapped, planted) is removed with a warning and built again, and never reaches dlopen. A failed build
leaves its log and a FAILED marker (not retried in later processes; `python -m kernels fastpath build` retries).
`KERNELS_FASTPATH`: auto (default: load if built, else start a detached builder on the first tune, which publishes
even when this process has exited; this process loads the library when the builder is done), build (build and
wait: tests and benchmarks), off.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import threading
import warnings
from pathlib import Path

import torch
from torch.utils import cpp_extension

from kernels.core import detached
from kernels.core.cache_root import cache_root, is_private_fallback, refuse_foreign
from kernels.core.config import config, tool_variable
from kernels.core.fsutil import file_lock, make_private_dirs
from kernels.native.fastpath_build import (MODULE_NAME, OUTPUT, BuildJob, BuildPaths, FastpathBuildError, failed_lately,
                                           published, read_note)

SOURCE = Path(__file__).resolve().parent / "csrc" / "fastpath.cpp"
_started: list[subprocess.Popen] = []   # detached builders this process started (kept so none is reaped early)


class FastpathWarning(RuntimeWarning):
    """A fastpath library on disk did not match its marker and was removed (it is built again)."""


def compiler() -> str:
    return tool_variable("CXX") or "c++"


def _compile_command(output: str) -> list[str]:
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler(), "-O2", "-std=c++20", "-fPIC", "-shared", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f"-I{p}" for p in includes], str(SOURCE), "-o", output,
            f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl", f"-Wl,-rpath,{torch_lib}"]


def paths() -> BuildPaths:
    tag_text = "\n".join([SOURCE.read_text(), torch.__version__, sys.version, sysconfig.get_config_var("SOABI") or "",
                          compiler()])
    tag = hashlib.sha256(tag_text.encode()).hexdigest()[:16]
    return BuildPaths.under(cache_root() / "fastpath" / tag, tag)


def build_job(where: BuildPaths, force: bool = False) -> BuildJob:
    return BuildJob(where, tuple(_compile_command(OUTPUT)), force)


def start_builder(job: BuildJob, wait: bool) -> subprocess.Popen:
    """Start a builder process for the job in its own session: it outlives this process (and a Ctrl-C meant for
    this one), and publishes or records its failure either way."""
    proc = detached.start("kernels.native.fastpath_build", job.to_json(), wait)
    _started.append(proc)
    return proc


def build(force: bool = False) -> Path:
    """Build the table unless a verified library is there, and wait for it; returns the library path. Raises
    FastpathBuildError."""
    where = paths()
    library = verified_library(where)
    if library is not None:
        return library
    if failed_lately(where) and not force:
        raise FastpathBuildError(f"an earlier build failed; log: {where.log}", read_note(where.log))
    make_private_dirs(where.folder)
    proc = start_builder(build_job(where, force), wait=True)
    _, errors = proc.communicate()
    return _outcome(where, proc.returncode, errors)


def _outcome(where: BuildPaths, returncode: int, errors: str = "") -> Path:
    """The published library once a builder exited, or FastpathBuildError saying why there is none."""
    library = published(where)
    if library is not None:
        return library
    if where.failed.exists():
        raise FastpathBuildError(f"{read_note(where.failed).strip()}; log: {where.log}", read_note(where.log))
    raise FastpathBuildError(f"the builder exited with {returncode} without publishing the library", errors[-4000:])


def verified_library(where: BuildPaths) -> Path | None:
    """The library when its marker vouches for it. A library that fails the check is removed (one warning), so the
    next build replaces it; not while a build holds the lock, since that build may be publishing it right now."""
    library = published(where)
    if library is not None or not os.path.lexists(where.library):
        return library
    try:
        with file_lock(where.lock, timeout_s=0):
            if published(where) is not None:
                return where.library
            os.unlink(where.library)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where.marker)
    except TimeoutError:
        return None                 # a build is running: its library is published with its marker
    except OSError as e:
        warnings.warn(f"kernels: the fastpath library {where.library} does not match its marker and cannot be "
                      f"removed ({e}); it is not loaded", FastpathWarning, stacklevel=3)
        return None
    warnings.warn(f"kernels: the fastpath library {where.library} does not match its marker (truncated, replaced "
                  f"or not built here); removed, it is built again", FastpathWarning, stacklevel=3)
    return None


def state(where: BuildPaths) -> str:
    """'built', 'failed' (lately: not tried again until forced), 'retry' (failed more than FAILED_RETRY_S ago: the
    next build tries again), 'unverified' (a library its marker does not vouch for) or 'absent'. Reads only."""
    if published(where) is not None:
        return "built"
    if os.path.lexists(where.library):
        return "unverified"
    if where.failed.exists():
        return "failed" if failed_lately(where) else "retry"
    return "absent"


def load_library(library: Path):
    """Import the built extension from its file (torch is imported first: the library links against it). Callers
    pass only a library its marker vouched for (verified_library, published); the check and the dlopen are not one
    step, so what keeps anyone else from swapping the file in between is the cache directory's permissions."""

    refuse_foreign(library, "the fastpath library")       # a folder others can write: its marker vouches for nothing
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(library))
    spec = importlib.util.spec_from_file_location(MODULE_NAME, str(library), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


_loaded: list = [None]      # the module once any Fastpath loaded it: launchers ask for it (loaded_module)


def loaded_module():
    """The loaded C++ module, or None (also with KERNELS_FASTPATH=off): Triton launchers attach native launches only
    when it is here."""
    return None if config.fastpath == "off" else _loaded[0]


def load_if_built() -> None:
    """Load the library when it is already built and verified (never builds, never removes): helper processes, such
    as the isolated verify-and-time child, then verify and time the same native launches the caller's warm path will
    use."""
    if loaded_module() is not None or config.fastpath == "off":
        return
    where = paths()
    if published(where) is not None:
        try:
            _loaded[0] = load_library(where.library)
        except (ImportError, OSError):
            pass            # the caller's own load reports it


class Fastpath:
    """Process state: the loaded module (or why not), and the thread that waits for a background build."""

    def __init__(self):
        self.module = None
        self.why_not = "not loaded yet"
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def try_load(self, on_loaded) -> None:
        """Called on cold calls: loads a verified library, or builds it per config.fastpath ('auto': a detached
        builder, and a thread here that loads its library when it is done). `on_loaded(module)` runs once, when the
        module becomes available: the caller registers its entries then, so a process that only makes warm calls
        after the background build still switches over."""
        if self.module is not None:
            return
        mode = config.fastpath
        if mode == "off":
            self.why_not = "KERNELS_FASTPATH=off"
            return
        with self._lock:
            if self._thread is not None:
                return          # a background build runs, or ran and loaded (or failed) already
            try:
                where = paths()
            except OSError as e:
                self.why_not = f"cannot read {SOURCE}: {e}"
                return
            library = verified_library(where)
            if library is None and failed_lately(where):
                self.why_not = f"build failed earlier; log: {where.log}"
                return
            if library is None and mode == "auto" and is_private_fallback():
                # a build into a temporary cache is gone with this process: ~20 s of g++ for nothing
                self.why_not = "the cache directory failed its checks: no background build into a temporary cache"
                return
            if library is None and mode == "auto":
                try:
                    make_private_dirs(where.folder)
                    proc = start_builder(build_job(where), wait=False)
                except OSError as e:
                    self.why_not = f"cannot start the builder: {e}"
                    return
                self.why_not = "building in the background"
                self._thread = threading.Thread(target=self._load_when_built, args=(where, proc, on_loaded),
                                                name="kernels-fastpath-build", daemon=True)
                self._thread.start()
                return
        if library is None:
            try:
                library = build()
            except FastpathBuildError as e:
                self.why_not = str(e)
                return
        self._load(library, on_loaded)

    def _load_when_built(self, where: BuildPaths, proc: subprocess.Popen, on_loaded) -> None:
        try:
            library = _outcome(where, proc.wait())
        except FastpathBuildError as e:
            self.why_not = str(e)
            return
        self._load(library, on_loaded)

    def _load(self, library: Path, on_loaded) -> None:
        try:
            module = load_library(library)
        except (ImportError, OSError) as e:
            self.why_not = f"load failed: {e}"
            return
        self.module, self.why_not = module, ""
        _loaded[0] = module
        on_loaded(module)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until a background build (if any) finishes."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
