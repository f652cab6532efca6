"""The built files a stored winner needs, read out of this cache for a bundle and written back into another.

What a winner needs, by backend (a padded winner: its inner choice's, on the padded problem):
- aten: nothing.
- triton, on a GPU problem: per kernel of the choice, its build record `triton/artifacts/<build key>.json` and the
  files of its folder in Triton's cache `triton/triton_cache/<group>/` (cubin, metadata, IR), which the record lists
  with their sha256. The rendered module (`triton/src`) does not travel: a load renders it again from the templates
  (content-addressed). A CPU problem runs through the interpreter: nothing is compiled, nothing travels.
- cutlass: `cutlass/sm<arch>/<key>/kernel.so` and its marker `meta.json` (size, sha256, nvcc and CUTLASS versions).

Keys are computed here, from the problem and the choice, with this machine's templates, Triton and toolchain: a
bundle's member names only select data out of the bundle, every destination is this cache's own content address.
Files are read once, without following links, and what was hashed is what is exported; on import every file is
checked against the record or marker that names it before it is written, atomically, marker or record last, so a
later load checks it again the way it checks what it built itself.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from backends import get_backend
from backends.cutlass import ArtifactPaths
from backends.cutlass import publish_marker as publish_cutlass_marker
from backends.padded import inner_problem
from backends.triton import triton_version
from backends.triton_render import build_key as triton_build_key
from backends.triton_render import render as render_triton
from backends.triton_templates import family as triton_family
from kernels.core.cache_root import cache_root
from kernels.core.choice import Choice
from kernels.core.fsutil import (
    atomic_write_bytes,
    atomic_write_text,
    file_lock,
    marker_valid,
    read_json,
    read_regular,
)
from kernels.core.problem import GemmProblem
from kernels.space.families import backend_of

HEX64 = re.compile(r"[0-9a-f]{64}")
KEY = re.compile(r"[0-9a-f]{32}")
# Triton's cache folder names and the file names in them (never "." or "..": a name starts with a word character)
CACHE_GROUP = re.compile(r"[A-Za-z0-9_-]{1,128}")
GROUP_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
KERNEL_STAGE = re.compile(r"[a-z0-9]{1,16}")       # cubin, ptx, llir, ttgir, ttir, source, json
TRITON_NAME_MAX = 150               # triton.compile: file_name = src.name[:150] (the OS's 255-character limit)
GROUP_INDEX = "__grp__"          # Triton's index of a folder: {"child_paths": {name: absolute path}}
MAX_ARTIFACT_BYTES = 1 << 30     # a built kernel is MiBs; a bundle takes none over 256 MiB (kernels.store.bundle)


class ArtifactError(ValueError):
    """Bundle data for an artifact is not what this cache would hold for it (the message says what differs)."""


@dataclass(frozen=True)
class Need:
    """One artifact a winner needs: its backend, its content address here, and what computes it."""
    backend: str                 # "triton" or "cutlass"
    key: str
    problem: GemmProblem
    choice: Choice
    kernel: str = ""             # triton: the kernel's name (a choice may launch several kernels)


@dataclass
class Collected:
    """An artifact read out of this cache: member name -> bytes, and what the environment check needs of it."""
    need: Need
    members: dict[str, bytes]
    toolchain: dict[str, str] = dataclasses.field(default_factory=dict)     # cutlass: nvcc and CUTLASS versions


def needs(problem: GemmProblem, choice: Choice) -> list[Need]:
    """The artifacts `choice` needs for `problem` on this machine (its templates, Triton and toolchain). Raises
    ArtifactError when the choice does not render here."""
    if choice.backend == "padded":
        template = choice.template[len("padded_"):]
        inner = Choice(backend_of(template), template, choice.dtype, choice.config, choice.params)
        return needs(inner_problem(problem), inner)
    try:
        if choice.backend == "triton":
            return _triton_needs(problem, choice)
        if choice.backend == "cutlass":
            key, _, _ = get_backend("cutlass").artifact_paths(problem, choice)
            return [Need("cutlass", key, problem, choice)]
    except Exception as e:
        raise ArtifactError(f"{choice.name} does not render here: {type(e).__name__}: {e}") from e
    return []


def _triton_needs(problem: GemmProblem, choice: Choice) -> list[Need]:
    if problem.device != "cuda":
        return []               # the interpreter runs the rendered module: nothing compiled
    found = []
    for spec in triton_family(choice.template).specs(problem, choice):
        key = triton_build_key(render_triton(spec), spec, f"cuda:{problem.arch}", triton_version())
        found.append(Need("triton", key, problem, choice, spec.kernel_name))
    return found


# -- reading (export, verify) -------------------------------------------------------------------------------------
def read_plain(path: Path) -> bytes:
    """A regular file's bytes, never through a link, never a FIFO's or a device's (OSError otherwise)."""
    return read_regular(path, MAX_ARTIFACT_BYTES, follow=False)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def triton_record(key: str) -> Path:
    """Where the Triton backend keeps a kernel's build record."""
    return get_backend("triton").root / "artifacts" / f"{key}.json"


def triton_folder(group: str) -> Path:
    """A compiled kernel's folder in Triton's cache, as the Triton backend points Triton at it."""
    return get_backend("triton").triton_cache_dir / group


def member_name(path: Path) -> str:
    """A file's name in a bundle: its path in the cache."""
    return path.relative_to(cache_root()).as_posix()


def triton_record_problem(record) -> str | None:
    """Why `record` is not a build record whose files can be found and checked, or None. Its files must be its own
    kernel's, as Triton names them (`<kernel>.<stage>`, `__grp__<kernel>.json`), none a shared library: Triton keeps
    its launcher (`__triton_launcher.so`) in folders of the same cache and loads it from there unchecked, so a bundle's
    record naming one could plant code that every later kernel runs (an attacker's probe)."""
    if not isinstance(record, dict):
        return "not an object"
    group, files, kernel = record.get("cache_group"), record.get("files"), record.get("kernel")
    if not (isinstance(group, str) and CACHE_GROUP.fullmatch(group)):
        return "its cache folder is not a plain name"
    if not (isinstance(files, dict) and files and all(isinstance(n, str) and GROUP_FILE.fullmatch(n) and
                                                      isinstance(h, str) and HEX64.fullmatch(h)
                                                      for n, h in files.items())):
        return "its file list is malformed"
    if not (isinstance(kernel, str) and all(_kernel_file(n, kernel) for n in files)):
        return "its file list names files that are not its kernel's"
    return None


def _kernel_file(name: str, kernel: str) -> bool:
    """Whether `name` is one of the files Triton writes for `kernel` (an IR stage, its metadata, its folder index),
    named, as triton.compile names them, by the kernel's name cut to TRITON_NAME_MAX characters."""
    kernel = kernel[:TRITON_NAME_MAX]
    if name == f"{GROUP_INDEX}{kernel}.json":
        return True
    stage = name.removeprefix(f"{kernel}.") if name.startswith(f"{kernel}.") else None
    return stage is not None and KERNEL_STAGE.fullmatch(stage) is not None and stage != "so"


def triton_record_intact(record_path: Path) -> str | None:
    """Why the record at `record_path` and the files it lists in Triton's cache do not match, or None."""
    try:
        record = json.loads(read_plain(record_path))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"unreadable ({e})"
    why = triton_record_problem(record)
    if why:
        return why
    folder = triton_folder(record["cache_group"])
    for name, digest in record["files"].items():
        try:
            if sha256(read_plain(folder / name)) != digest:
                return f"{folder / name} does not match its record"
        except OSError as e:
            return f"{folder / name}: {e.strerror or e}"
    return None


def collect(need: Need) -> Collected | str:
    """The artifact's files from this cache (member name -> bytes), or why it cannot be carried."""
    return _collect_triton(need) if need.backend == "triton" else _collect_cutlass(need)


def _collect_triton(need: Need) -> Collected | str:
    record_path = triton_record(need.key)
    try:
        raw = read_plain(record_path)
        record = json.loads(raw)
    except FileNotFoundError:
        return f"Triton kernel {need.kernel} is not compiled in this cache"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"Triton kernel {need.kernel}: build record unreadable ({e})"
    why = triton_record_problem(record) or (None if record.get("kernel") == need.kernel else "of another kernel")
    if why:
        return f"Triton kernel {need.kernel}: build record {why}"
    members = {member_name(record_path): raw}
    folder = triton_folder(record["cache_group"])
    for name, digest in sorted(record["files"].items()):
        try:
            data = read_plain(folder / name)
        except OSError as e:
            return f"Triton kernel {need.kernel}: {folder / name}: {e.strerror or e}"
        if sha256(data) != digest:
            return f"Triton kernel {need.kernel}: {folder / name} does not match its record (`cache verify`)"
        members[member_name(folder / name)] = data
    return Collected(need, members)


def _cutlass_paths(need: Need) -> tuple[ArtifactPaths, str, str]:
    """The binary's paths here, and its and its marker's member names (their paths in the cache)."""
    _, paths, _ = get_backend("cutlass").artifact_paths(need.problem, need.choice)
    return paths, member_name(paths.binary), member_name(paths.marker)


def _collect_cutlass(need: Need) -> Collected | str:
    paths, binary_member, marker_member = _cutlass_paths(need)
    try:
        binary, marker = read_plain(paths.binary), read_plain(paths.marker)
        meta = json.loads(marker)
    except FileNotFoundError:
        return f"CUTLASS binary of {need.choice.name} is not built in this cache"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return f"CUTLASS binary of {need.choice.name}: {e}"
    why = _cutlass_marker_problem(meta, need.key, binary)
    if why:
        return f"CUTLASS binary of {need.choice.name}: {why} (`cache verify`)"
    return Collected(need, {binary_member: binary, marker_member: marker},
                     {"nvcc": str(meta.get("nvcc", "")), "cutlass": str(meta.get("cutlass", ""))})


def _cutlass_marker_problem(meta, key: str, binary: bytes) -> str | None:
    if not isinstance(meta, dict) or meta.get("key") != key:
        return "its marker is not this key's"
    if meta.get("size") != len(binary) or meta.get("sha256") != sha256(binary):
        return "it does not match its marker"
    if not all(isinstance(meta.get(k, ""), str) for k in ("nvcc", "cutlass")):
        return "its marker's toolchain versions are malformed"
    return None


# -- writing (import) ---------------------------------------------------------------------------------------------
@dataclass
class Install:
    """What one artifact's import writes, checked against its record or marker and the bundle's hashes: the files,
    then (Triton) its build record, or (CUTLASS) a marker published over the written binary with `marker_info`."""
    need: Need
    files: list[tuple[Path, bytes]]
    record: tuple[Path, str] | None = None
    marker_info: dict | None = None


def plan(need: Need, members: Mapping[str, bytes]) -> Install | str:
    """How to install the bundle's copy of `need` into this cache, or why the bundle has none that fits (checked:
    nothing is written here). `members` hold bytes already checked against the bundle's manifest."""
    return _plan_triton(need, members) if need.backend == "triton" else _plan_cutlass(need, members)


def _plan_triton(need: Need, members: Mapping[str, bytes]) -> Install | str:
    record_path = triton_record(need.key)
    raw = members.get(member_name(record_path))
    if raw is None:
        return f"the bundle has no Triton kernel {need.kernel} for this machine's build key"
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"Triton build record {need.key}: {e}") from e
    why = triton_record_problem(record)
    if why is None and (record.get("kernel") != need.kernel or record.get("triton") != triton_version()
                        or record.get("arch") != need.problem.arch):
        why = "is for another kernel, Triton or arch"
    if why:
        raise ArtifactError(f"Triton build record {need.key} {why}")
    group = record["cache_group"]
    folder = triton_folder(group)
    files, index = [], None
    for name, digest in sorted(record["files"].items()):
        data = members.get(member_name(folder / name))
        if data is None:
            raise ArtifactError(f"Triton kernel {need.kernel}: the bundle lacks {group}/{name}")
        if sha256(data) != digest:
            raise ArtifactError(f"Triton kernel {need.kernel}: {group}/{name} does not match its build record")
        if name.startswith(GROUP_INDEX):
            index = name
            continue
        files.append((folder / name, data))
    if index is not None:
        # Triton's index names its files by absolute path: rewritten for this cache, and the record with it
        text = _relocated_index(members[member_name(folder / index)], folder, record["files"], need)
        files.append((folder / index, text.encode()))
        record = dict(record, files=dict(record["files"], **{index: sha256(text.encode())}))
    return Install(need, files, record=(record_path, json.dumps(record, sort_keys=True, indent=1)))


def _relocated_index(data: bytes, folder: Path, files: dict, need: Need) -> str:
    try:
        children = json.loads(data)["child_paths"]
    except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise ArtifactError(f"Triton kernel {need.kernel}: its cache index is malformed ({e})") from e
    if not (isinstance(children, dict) and all(isinstance(n, str) and n in files and not n.startswith(GROUP_INDEX)
                                               for n in children)):
        raise ArtifactError(f"Triton kernel {need.kernel}: its cache index names files the record does not list")
    return json.dumps({"child_paths": {name: str(folder / name) for name in children}})


def _plan_cutlass(need: Need, members: Mapping[str, bytes]) -> Install | str:
    paths, binary_member, marker_member = _cutlass_paths(need)
    binary, marker = members.get(binary_member), members.get(marker_member)
    if binary is None or marker is None:
        return f"the bundle has no CUTLASS binary of {need.choice.name} for this machine's key (nvcc, CUTLASS)"
    try:
        meta = json.loads(marker)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"CUTLASS marker {need.key}: {e}") from e
    why = _cutlass_marker_problem(meta, need.key, binary)
    if why:
        raise ArtifactError(f"CUTLASS binary {need.key}: {why}")
    info = {k: meta[k] for k in ("choice", "arch", "flags", "nvcc", "cutlass") if k in meta}    # what a build records
    return Install(need, [(paths.binary, binary)], marker_info=info)


def installed(need: Need) -> bool:
    """Whether this cache holds a good copy of the artifact already (then an import leaves it alone)."""
    if need.backend == "triton":
        return triton_record_intact(triton_record(need.key)) is None
    _, paths, _ = get_backend("cutlass").artifact_paths(need.problem, need.choice)
    return marker_valid(paths.binary, paths.marker, need.key)


def install(step: Install) -> bool:
    """Write the artifact (files first, its record or marker last). False when a good copy was here already."""
    if step.marker_info is None:
        if installed(step.need):
            return False
        for path, data in step.files:
            write_bytes_atomic(path, data)
        atomic_write_text(*step.record)
        return True
    (binary, data), = step.files
    paths = ArtifactPaths(binary.parent)
    with file_lock(get_backend("cutlass").root / "build.lock"):     # not while a build of the same key publishes
        if installed(step.need):
            return False
        write_bytes_atomic(binary, data)
        publish_cutlass_marker(paths, step.need.key, step.marker_info)
        meta = read_json(paths.marker) or {}
        if meta.get("sha256") != sha256(data) or not installed(step.need):
            with contextlib.suppress(FileNotFoundError):       # changed under us: leave a miss, never a wrong marker
                paths.marker.unlink()
            raise ArtifactError(f"CUTLASS binary {step.need.key} changed while it was written")
    return True


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """fsutil.atomic_write_bytes, refusing a directory that is a symbolic link (nothing is written through one)."""
    if path.parent.is_dir() and stat.S_ISLNK(os.lstat(path.parent).st_mode):
        raise ArtifactError(f"{path.parent} is a symbolic link: nothing is written through it")
    atomic_write_bytes(path, data)
