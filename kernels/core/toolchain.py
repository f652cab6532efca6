"""Where the CUTLASS headers and nvcc come from, resolved in one place.

CUTLASS: $CUTLASS_DIR (a checkout) -> <repo>/third_party/cutlass -> the headers shipped in the `nvidia-cutlass` wheel
(cutlass_library/source). nvcc: $PATH -> $CUDA_HOME/bin -> /usr/local/cuda/bin. Nothing here raises for a missing
tool: the result says what was found and, when unusable, everything that was tried.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_VERSION_RE = re.compile(r"#define\s+CUTLASS_(MAJOR|MINOR|PATCH)\s+(\d+)")


@dataclass(frozen=True)
class CutlassDir:
    """A usable CUTLASS header tree: `include` and `tools/util/include` both exist."""
    root: Path
    source: str                 # "CUTLASS_DIR", "third_party", "nvidia-cutlass"
    version: str

    @property
    def include_dirs(self) -> tuple[Path, Path]:
        return self.root / "include", self.root / "tools" / "util" / "include"


@dataclass(frozen=True)
class Toolchain:
    cutlass: CutlassDir | None
    nvcc: Path | None
    nvcc_version: str           # "13.0.88", "" when nvcc is missing
    tried: tuple[str, ...] = field(default=())   # one line per place looked at, with why it was rejected

    @property
    def usable(self) -> bool:
        return self.cutlass is not None and self.nvcc is not None

    @property
    def message(self) -> str:
        """'' when usable, else what is missing and everything that was tried."""
        if self.usable:
            return ""
        missing = [what for what, found in (("CUTLASS headers", self.cutlass), ("nvcc", self.nvcc)) if found is None]
        return f"{' and '.join(missing)} not found; tried: " + "; ".join(self.tried)


def cutlass_version(root: Path) -> str:
    try:
        text = (root / "include" / "cutlass" / "version.h").read_text()
    except OSError:
        return "unknown"
    parts = dict(_VERSION_RE.findall(text))
    return ".".join(parts.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH")) if parts else "unknown"


def _check_cutlass_root(root: Path) -> str:
    """'' when `root` holds the headers we need, else why not."""
    if not root.is_dir():
        return "no such directory"
    for sub in ("include/cutlass/cutlass.h", "include/cute/tensor.hpp", "tools/util/include/cutlass/util"):
        if not (root / sub).exists():
            return f"missing {sub}"
    return ""


def _package_root() -> Path | None:
    """cutlass_library/source of the nvidia-cutlass wheel, found without importing the package (its import is slow)."""
    try:
        spec = importlib.util.find_spec("cutlass_library")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "source"


def resolve_cutlass(env: dict | None = None, repo_root: Path = REPO_ROOT,
                    package_root: Path | None | bool = True) -> tuple[CutlassDir | None, list[str]]:
    """The first usable CUTLASS tree and the list of places tried. `package_root=True` looks the wheel up."""
    env = os.environ if env is None else env
    candidates: list[tuple[str, Path | None]] = []
    if env.get("CUTLASS_DIR"):
        candidates.append(("CUTLASS_DIR", Path(env["CUTLASS_DIR"]).expanduser()))
    else:
        candidates.append(("CUTLASS_DIR", None))
    candidates.append(("third_party", repo_root / "third_party" / "cutlass"))
    candidates.append(("nvidia-cutlass", _package_root() if package_root is True else package_root or None))
    tried: list[str] = []
    for source, root in candidates:
        if root is None:
            tried.append(f"{source}: not set" if source == "CUTLASS_DIR" else f"{source}: package not installed")
            continue
        why = _check_cutlass_root(root)
        if not why:
            return CutlassDir(root.resolve(), source, cutlass_version(root)), tried
        tried.append(f"{source} {root}: {why}")
    return None, tried


def find_nvcc(env: dict | None = None) -> tuple[Path | None, list[str]]:
    env = os.environ if env is None else env
    tried: list[str] = []
    on_path = shutil.which("nvcc", path=env.get("PATH"))
    if on_path:
        return Path(on_path), tried
    tried.append("nvcc: not on PATH")
    homes = [("CUDA_HOME", env.get("CUDA_HOME")), ("CUDA_PATH", env.get("CUDA_PATH")), ("default", "/usr/local/cuda")]
    for label, home in homes:
        if not home:
            continue
        path = Path(home) / "bin" / "nvcc"
        if path.is_file() and os.access(path, os.X_OK):
            return path, tried
        tried.append(f"nvcc: {label} {path} not found")
    return None, tried


@functools.lru_cache(maxsize=8)
def nvcc_version(nvcc: Path) -> str:
    """'13.0.88' from `nvcc --version`; '' when it cannot be run."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    match = re.search(r"V(\d+\.\d+\.\d+)", out) or re.search(r"release (\d+\.\d+)", out)
    return match.group(1) if match else ""


def resolve(env: dict | None = None, repo_root: Path = REPO_ROOT) -> Toolchain:
    cutlass, tried = resolve_cutlass(env, repo_root)
    nvcc, nvcc_tried = find_nvcc(env)
    version = nvcc_version(nvcc) if nvcc else ""
    if nvcc is not None and not version:
        nvcc_tried.append(f"nvcc {nvcc}: `--version` failed")
        nvcc = None
    return Toolchain(cutlass, nvcc, version, tuple(tried + nvcc_tried))


@functools.lru_cache(maxsize=1)
def toolchain() -> Toolchain:
    """The process-wide toolchain (call `toolchain.cache_clear()` after changing the environment)."""
    return resolve()
