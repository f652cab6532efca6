"""The C++ warm-call table (kernels/csrc/fastpath.cpp): built once per torch/Python/source, loaded when present.

Why: a warm `kernels.mm` in Python builds a 13-field key from tensor attributes (~1 us here, ~2 us on the H100's
host) before it reaches torch.mm; for host-bound problems that is the whole gap to torch.mm. The C++ table reads the
same fields from the TensorImpls and calls at::mm itself.

Build: one g++ call ($CXX, default c++) against torch's headers (~15-25 s on 2 cores), into
<cache_dir>/fastpath/<tag>/ (one library per torch/Python/source/compiler), published with os.replace so concurrent
builders and killed builds never leave a half-written library where a loader looks. A failed build leaves its log and
a FAILED marker (not retried in later processes; `python -m kernels fastpath build` retries). `KERNELS_FASTPATH`: auto
(default: load if built, else build in a background thread on the first tune), build (build in the caller, blocking:
tests and benchmarks), off.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils import cpp_extension

from kernels.core.cache_root import cache_root
from kernels.core.config import config, tool_variable

SOURCE = Path(__file__).resolve().parent / "csrc" / "fastpath.cpp"
MODULE_NAME = "_kernels_fastpath"
BUILD_TIMEOUT_S = 600


class FastpathBuildError(RuntimeError):
    """The C++ table did not build; carries the command and the compiler's output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class BuildPaths:
    folder: Path
    library: Path
    failed: Path
    log: Path


def compiler() -> str:
    return tool_variable("CXX") or "c++"


def _compile_command(output: Path) -> list[str]:
    torch_lib = Path(torch.__file__).resolve().parent / "lib"
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler(), "-O2", "-std=c++20", "-fPIC", "-shared", "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *[f"-I{p}" for p in includes], str(SOURCE), "-o", str(output),
            f"-L{torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl", f"-Wl,-rpath,{torch_lib}"]


def paths() -> BuildPaths:
    tag_text = "\n".join([SOURCE.read_text(), torch.__version__, sys.version, sysconfig.get_config_var("SOABI") or "",
                          compiler()])
    tag = hashlib.sha256(tag_text.encode()).hexdigest()[:16]
    folder = cache_root() / "fastpath" / tag
    return BuildPaths(folder, folder / f"{MODULE_NAME}.so", folder / "FAILED", folder / "build.log")


def build(force: bool = False) -> Path:
    """Compile the table unless already built; returns the library path. Raises FastpathBuildError."""
    where = paths()
    if where.library.exists():
        return where.library
    if where.failed.exists() and not force:
        raise FastpathBuildError(f"an earlier build failed; log: {where.log}", _read(where.log))
    where.folder.mkdir(parents=True, exist_ok=True)
    tmp = where.folder / f".{MODULE_NAME}.{os.getpid()}.{uuid.uuid4().hex[:8]}.so"
    cmd = _compile_command(tmp)
    if shutil.which(cmd[0]) is None:
        _fail(where, f"C++ compiler {cmd[0]!r} not found (set CXX)", "")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        _fail(where, f"compile timed out after {BUILD_TIMEOUT_S} s", " ".join(cmd))
        raise AssertionError("unreachable") from e
    try:
        if proc.returncode != 0:
            _fail(where, f"compile failed (exit {proc.returncode})", " ".join(cmd) + "\n" + proc.stderr[-20000:])
        os.replace(tmp, where.library)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(FileNotFoundError):
        where.failed.unlink()
    return where.library


def _fail(where: BuildPaths, message: str, log: str):
    where.folder.mkdir(parents=True, exist_ok=True)
    where.log.write_text(f"{message}\n{log}")
    where.failed.write_text(message + "\n")
    raise FastpathBuildError(f"{message}; log: {where.log}", log)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def load_library(library: Path):
    """Import the built extension from its file (torch is imported first: the library links against it)."""

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
    """Load the library when it is already built (never builds): helper processes, such as the isolated
    verify-and-time child, then verify and time the same native launches the caller's warm path will use."""
    if loaded_module() is not None or config.fastpath == "off":
        return
    where = paths()
    if where.library.exists():
        try:
            _loaded[0] = load_library(where.library)
        except (ImportError, OSError):
            pass            # the caller's own load reports it


class Fastpath:
    """Process state: the loaded module (or why not), and the background build when one runs."""

    def __init__(self):
        self.module = None
        self.why_not = "not loaded yet"
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def try_load(self, on_loaded) -> None:
        """Called on cold calls: loads a built library, or builds it per config.fastpath (in a background thread for
        'auto'). `on_loaded(module)` runs once, when the module becomes available: the caller registers its entries
        then, so a process that only makes warm calls after the background build still switches over."""
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
            if not where.library.exists() and where.failed.exists():
                self.why_not = f"build failed earlier; log: {where.log}"
                return
            if not where.library.exists() and mode == "auto":
                self.why_not = "building in the background"
                self._thread = threading.Thread(target=self._build_and_load, args=(on_loaded,),
                                                name="kernels-fastpath-build", daemon=True)
                self._thread.start()
                return
        self._build_and_load(on_loaded)

    def _build_and_load(self, on_loaded) -> None:
        try:
            library = build()
            module = load_library(library)
        except FastpathBuildError as e:
            self.why_not = str(e)
            return
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
