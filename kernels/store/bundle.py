"""Cache bundles: `python -m kernels cache export FILE` writes stored selections and the built files their winners
need (kernels.store.winner_artifacts) into one file; `cache import FILE` puts them into another machine's cache, so a
fresh process there neither tunes nor compiles the problems the bundle carries.

The file is a gzip-compressed tar (`.tar.gz`): members are plain files named as they sit in a cache, readable with
`tar tzf`, gzip's CRC catches truncation, and the standard library reads it member by member without extracting
anything (nothing here calls tarfile's extract: every byte is read into memory, checked, then written by our own
atomic writers to paths this cache computes). `manifest.json` comes first: the format and version, every member's
size and sha256, and per selection its environment (kernels.store.environment: GPU and compute capability, torch,
CUDA, Triton, template sources, kernels version; nvcc and CUTLASS for a CUTLASS winner), its winner and the members
its artifacts are.

Import, in order, writing nothing until every check passed: each member must be a regular file (no link, device or
directory) with a name of one of the shapes a cache has (no absolute path, no `..`), listed in the manifest with its
size and hash; each selection must pass the store's schema (data, never code) and belong to the key its environment
is read from; entries for another environment refuse the bundle, naming the part that differs (`--partial` imports
the matching ones). Then artifacts are written (kernels.store.winner_artifacts: checked against their record or
marker, atomic, record or marker last), then selections, each under the store's per-key lock, never over a local
entry with a later or equal `created`. Concurrent imports meet at those locks and atomic renames.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import gzip
import io
import json
import os
import re
import tarfile
import time
import uuid
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from kernels.core.cache_root import cache_root
from kernels.core.fsutil import open_regular
from kernels.core.problem import GemmProblem
from kernels.store import environment
from kernels.store.cache_admin import StoredEntry, entries, parse_entry, selections_dir
from kernels.store.environment import Environment
from kernels.store.selections import SelectionStore
from kernels.store.winner_artifacts import (
    ArtifactError,
    Collected,
    Install,
    collect,
    install,
    needs,
    plan,
    sha256,
)

FORMAT = "kernels-bundle"
VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20
# read into memory before their hashes are checked: a built kernel is MiBs (a CUTLASS binary ~5-20), a bundle of every
# winner of a cache well under a GiB
MAX_MEMBER_BYTES = 256 << 20
MAX_TOTAL_BYTES = 2 << 30
# the member names a bundle may hold: where each sits in a cache (never absolute, never "..": no component starts
# with a dot)
MEMBER = re.compile(r"selections/[0-9a-f]{32}\.json"
                    r"|triton/artifacts/[0-9a-f]{32}\.json"
                    r"|triton/triton_cache/[A-Za-z0-9_-]{1,128}/[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}"
                    r"|cutlass/sm[0-9]{2,3}/[0-9a-f]{32}/(?:kernel\.so|meta\.json)")
SELECTION_MEMBER = re.compile(r"selections/[0-9a-f]{32}\.json")


# What reading a bundle may decompress at most: the members' limit, the manifest's, and room for tar's own headers
MAX_READ_BYTES = MAX_TOTAL_BYTES + MAX_MANIFEST_BYTES + (64 << 20)
# A tar extended header (pax, GNU long name) is read whole before any member's limit applies: 765 KB of gzip that
# declared a 768 MiB pax header took 2.6 GB of memory (an attacker's probe). Ours hold a member's name: bytes
MAX_HEADER_BYTES = 64 << 10


class BundleError(Exception):
    """A bundle cannot be written or imported; the message says which file, member or environment part, and that
    nothing was imported."""


class _Inflated(Exception):
    """Reading a bundle would take more memory than one needs (the caps above); read_bundle names the file."""


class _BoundedTarInfo(tarfile.TarInfo):
    """tar's extended headers refused past MAX_HEADER_BYTES before they are read (tarfile reads them whole)."""

    def _bounded(self) -> None:
        if self.size > MAX_HEADER_BYTES:
            raise _Inflated(f"a tar extended header of {self.size} bytes (over {MAX_HEADER_BYTES})")

    def _proc_pax(self, tarfile):
        self._bounded()
        return super()._proc_pax(tarfile)

    def _proc_gnulong(self, tarfile):
        self._bounded()
        return super()._proc_gnulong(tarfile)

    # sparse members (GNU's, pax's 1.0) read their maps block by block into Python tuples, ~11x what they inflate
    # to (a reviewer's 458 KB file took 1.5 GB): export never writes one, so one is refused before its map is read
    def _proc_sparse(self, tarfile):
        raise _Inflated("a sparse member")

    def _proc_gnusparse_10(self, next, pax_headers, tarfile):
        raise _Inflated("a sparse member")


class _CappedReader(io.RawIOBase):
    """A bundle's gzip stream, decompressed no further than MAX_READ_BYTES (a small file may inflate without end)."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.seen = stream, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.seen += len(data)
        if self.seen > MAX_READ_BYTES:
            raise _Inflated(f"it inflates past {MAX_READ_BYTES} bytes, more than a bundle holds")
        return data


# -- export ---------------------------------------------------------------------------------------------------------
@dataclass
class ExportReport:
    path: Path
    selections: int
    artifacts: int
    size: int
    missing: list[str] = field(default_factory=list)      # winners' artifacts not carried (built on first use)
    skipped: int = 0                                       # invalid store entries left out (`cache verify`)
    not_stored: int = 0                                    # listed problems the store has no selection for


def export_bundle(path: Path, patterns: tuple[str, ...] = (), problems: list[GemmProblem] | None = None
                  ) -> ExportReport:
    """Write stored selections and their winners' artifacts to `path`, atomically: all of them, or those matching
    `patterns` (key prefixes as `cache list` shows them, or shell patterns on the problem's name) or `problems` (on
    whichever device they were tuned: a problem list or trace names none)."""
    good, bad = entries()
    wanted = {_anywhere(p) for p in problems or ()}
    chosen = [e for e in good if (not patterns and problems is None) or _matches(e, patterns)
              or _anywhere(e.selection.problem) in wanted]
    if not chosen:
        what = f" matching {', '.join(patterns)}" if patterns else ""
        what += f"{' or' if patterns else ''} of the {len(wanted)} problems listed" if problems is not None else ""
        raise BundleError(f"no stored selection{what} in {selections_dir()}: nothing to export")
    # a pattern that matches nothing is a typo or a problem not tuned here: exporting the rest without it would
    # leave the bundle short with no sign of it
    unmatched = [p for p in patterns if not any(_matches(e, (p,)) for e in good)]
    if unmatched:
        raise BundleError(f"--problems {', '.join(unmatched)}: no stored selection matches (a key prefix as `cache "
                          f"list` shows it, or a shell pattern on the problem such as '*4096x4096x4096*'); nothing "
                          "exported")
    not_stored = len(wanted - {_anywhere(e.selection.problem) for e in chosen})
    local = environment.software()
    members: dict[str, bytes] = {}
    environments: list[dict] = []
    listed, missing = [], []
    for entry in chosen:
        carried, notes = _carried(entry)
        missing.extend(f"{entry.problem_name}: {n}" for n in notes)
        toolchain = next((c.toolchain for c in carried if c.toolchain), None)
        cuda = local["cuda"] if entry.env.get("torch") == local["torch"] else ""
        env = entry.environment(cuda, toolchain).as_dict()
        if env not in environments:
            environments.append(env)
        member = f"selections/{entry.key_id}.json"
        members[member] = entry.raw
        artifact_members = sorted({name for c in carried for name in c.members})
        for c in carried:
            members.update(c.members)
        sel = entry.selection
        listed.append({"member": member, "problem": entry.problem_name, "winner": sel.winner,
                       "created": sel.created, "environment": environments.index(env),
                       "artifacts": artifact_members, "missing": notes})
    big = [name for name, data in members.items() if len(data) > MAX_MEMBER_BYTES]
    total = sum(len(data) for data in members.values())
    if big or total > MAX_TOTAL_BYTES:        # what import would refuse: refused here, before anything is written
        raise BundleError(f"{path}: the bundle would break the limits import takes ({MAX_MEMBER_BYTES} bytes a "
                          f"member, {MAX_TOTAL_BYTES} in all): " + (f"{big[0]} is {len(members[big[0]])} bytes"
                          if big else f"{total} bytes in all") + "; export fewer problems (--problems)")
    manifest = {"format": FORMAT, "version": VERSION, "created": time.time(),
                "exported_by": dict(local, gpus=[list(g) for g in environment.here(toolchain=False).gpus]),
                "environments": environments, "entries": listed,
                "members": {name: {"size": len(data), "sha256": sha256(data)} for name, data in sorted(members.items())}}
    size = _write_atomic(Path(path), manifest, members)
    return ExportReport(Path(path), len(listed), len(members) - len(listed), size, missing, len(bad), not_stored)


def _matches(entry: StoredEntry, patterns: tuple[str, ...]) -> bool:
    # the name itself too: `cache list` shows strides as "[32, 1]", which a shell pattern reads as a character class
    name = entry.problem_name
    return any(entry.key_id.startswith(p.lower()) or name == p or fnmatch.fnmatchcase(name, p) for p in patterns)


def _anywhere(problem: GemmProblem) -> GemmProblem:
    return dataclasses.replace(problem, device="", arch=0, device_name="")


def _carried(entry: StoredEntry) -> tuple[list[Collected], list[str]]:
    """The winner's artifacts read from this cache, and why any is not carried."""
    try:
        wanted = needs(entry.selection.problem, entry.selection.winner_choice)
    except ArtifactError as e:
        return [], [str(e)]
    carried, notes = [], []
    for need in wanted:
        found = collect(need)
        (notes if isinstance(found, str) else carried).append(found)
    return carried, notes


def _write_atomic(path: Path, manifest: dict, members: dict[str, bytes]) -> int:
    """The tar.gz at `path`: a fresh temp file beside it (O_EXCL, never through a link), then os.replace (which
    replaces a link at `path` rather than writing through it). Returns its size."""
    if not path.parent.is_dir():
        raise BundleError(f"cannot write {path}: {path.parent} is not a directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w",
                                                                                   format=tarfile.PAX_FORMAT) as tar:
                _add(tar, MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
                for name, data in sorted(members.items()):
                    _add(tar, name, data)
            raw.flush()
            os.fsync(raw.fileno())
        size = tmp.stat().st_size
        os.replace(tmp, path)
        return size
    except OSError as e:
        raise BundleError(f"cannot write {path}: {e.strerror or e}") from e
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o600, 0
    tar.addfile(info, io.BytesIO(data))


# -- reading --------------------------------------------------------------------------------------------------------
@dataclass
class Entry:
    """One selection of a bundle, checked: the stored entry it holds, its environment and artifact members."""
    stored: StoredEntry
    env: Environment
    artifacts: list[str]


@dataclass
class Bundle:
    manifest: dict
    members: dict[str, bytes]          # every member's bytes, each checked against the manifest
    entries: list[Entry]


def read_bundle(path: Path) -> Bundle:
    """The bundle at `path`, every member checked (type, name, size, sha256) and every selection validated; raises
    BundleError naming the first thing wrong. Writes nothing."""
    try:
        # a regular file only: a FIFO would block the open, a device such as /dev/zero would be read without end
        fd = open_regular(path)
    except FileNotFoundError as e:
        raise BundleError(f"{path}: no such file") from e
    except OSError as e:
        raise BundleError(f"{path}: cannot be read: {e.strerror or e}; nothing imported") from e
    try:
        # gzip, as export writes it, read as a stream through the caps above (tarfile's own "r:*" would inflate
        # whatever a header declares)
        with os.fdopen(fd, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz, \
                tarfile.open(fileobj=_CappedReader(gz), mode="r|", tarinfo=_BoundedTarInfo) as tar:
            manifest, members = _read_members(tar, path)
    except BundleError:
        raise
    except _Inflated as e:
        raise BundleError(f"{path} is not a kernels bundle: {e}; nothing imported") from e
    except gzip.BadGzipFile as e:
        raise BundleError(f"{path} is not a gzip file, so not a kernels bundle (export writes .tar.gz); nothing "
                          "imported") from e
    except (tarfile.TarError, EOFError, zlib.error, OSError, ValueError) as e:
        raise BundleError(f"{path} is truncated or not a kernels bundle ({type(e).__name__}: {e}); nothing "
                          "imported") from e
    absent = sorted(set(manifest["members"]) - set(members))
    if absent:
        raise BundleError(f"{path} is truncated: {len(absent)} members the manifest lists are missing (first "
                          f"{absent[0]}); nothing imported")
    return Bundle(manifest, members, [_entry(path, manifest, members, e) for e in manifest["entries"]])


def _read_members(tar: tarfile.TarFile, path: Path) -> tuple[dict, dict[str, bytes]]:
    manifest, members, total = None, {}, 0
    for info in tar:
        name = info.name
        if not info.isreg():
            kind = "a link" if info.issym() or info.islnk() else "a directory" if info.isdir() else "a device or fifo"
            raise BundleError(f"{path}: member {name!r} is {kind}, not a plain file; nothing imported")
        if manifest is None:
            if name != MANIFEST:
                raise BundleError(f"{path}: the first member is {name!r}, not {MANIFEST}: not a kernels bundle")
            if info.size > MAX_MANIFEST_BYTES:
                raise BundleError(f"{path}: its manifest is {info.size} bytes, over {MAX_MANIFEST_BYTES}")
            manifest = _manifest(path, _read(tar, info))
            continue
        if not MEMBER.fullmatch(name):
            raise BundleError(f"{path}: member {name!r} is not a name a cache holds (absolute paths, `..` and "
                              "unknown folders are refused); nothing imported")
        expected = manifest["members"].get(name)
        if expected is None:
            raise BundleError(f"{path}: member {name!r} is not in the manifest; nothing imported")
        if name in members:
            raise BundleError(f"{path}: member {name!r} appears twice; nothing imported")
        if info.size > MAX_MEMBER_BYTES or total + info.size > MAX_TOTAL_BYTES:
            raise BundleError(f"{path}: member {name!r} ({info.size} bytes) takes the bundle over its limits "
                              f"({MAX_MEMBER_BYTES} bytes a member, {MAX_TOTAL_BYTES} in all); nothing imported")
        if info.size != expected["size"]:
            raise BundleError(f"{path}: member {name!r} is {info.size} bytes, the manifest says {expected['size']}; "
                              "nothing imported")
        data = _read(tar, info)
        if sha256(data) != expected["sha256"]:
            raise BundleError(f"{path}: member {name!r} does not match its sha256 in the manifest (changed after "
                              "export); nothing imported")
        members[name] = data
        total += len(data)
    if manifest is None:
        raise BundleError(f"{path} is empty: no {MANIFEST}")
    return manifest, members


def _read(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    data = tar.extractfile(info).read()
    if len(data) != info.size:
        raise EOFError(f"member {info.name!r} ends after {len(data)} of {info.size} bytes")
    return data


def _manifest(path: Path, raw: bytes) -> dict:
    """The manifest, its shape checked: what the rest of the import reads from it is what it says it is."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:      # deep nesting too
        raise BundleError(f"{path}: the manifest is not JSON ({type(e).__name__}: {e})") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise BundleError(f"{path}: not a kernels bundle (manifest format {_get(data, 'format')!r}, expected "
                          f"{FORMAT!r})")
    if data.get("version") != VERSION:
        raise BundleError(f"{path}: bundle format version {data.get('version')!r}; this kernels reads version "
                          f"{VERSION} (export it again with this version)")
    members, envs, listed = data.get("members"), data.get("environments"), data.get("entries")
    if not (isinstance(members, dict) and all(isinstance(m, dict) and type(m.get("size")) is int and m["size"] >= 0
                                              and isinstance(m.get("sha256"), str)
                                              and re.fullmatch(r"[0-9a-f]{64}", m["sha256"])
                                              for m in members.values())):
        raise BundleError(f"{path}: the manifest's member list is malformed (wrong schema)")
    for name in members:
        if not MEMBER.fullmatch(name):
            raise BundleError(f"{path}: the manifest lists member {name!r}, which is not a name a cache holds "
                              "(absolute paths, `..` and unknown folders are refused); nothing imported")
    try:
        data["environments"] = [Environment.from_dict(e) for e in envs] if isinstance(envs, list) else None
    except ValueError as e:
        raise BundleError(f"{path}: the manifest's environments are malformed ({e})") from e
    if data["environments"] is None or not isinstance(listed, list) or not listed:
        raise BundleError(f"{path}: the manifest lists no environments or no selections (wrong schema)")
    for item in listed:
        if not (isinstance(item, dict) and isinstance(item.get("member"), str)
                and SELECTION_MEMBER.fullmatch(item["member"]) and item["member"] in members
                and type(item.get("environment")) is int and 0 <= item["environment"] < len(envs)
                and isinstance(item.get("artifacts"), list)
                and all(isinstance(a, str) and a in members for a in item["artifacts"])):
            raise BundleError(f"{path}: a manifest entry is malformed (wrong schema): {str(item)[:200]}")
    return data


def _get(data, key):
    return data.get(key) if isinstance(data, dict) else None


def _entry(path: Path, manifest: dict, members: dict[str, bytes], item: dict) -> Entry:
    name = item["member"]
    stored = parse_entry(members[name], name.rsplit("/", 1)[1])
    if isinstance(stored, str):
        raise BundleError(f"{path}: selection {name} is refused: {stored}; nothing imported")
    env: Environment = manifest["environments"][item["environment"]]
    recorded = stored.environment(env.cuda, {"nvcc": env.nvcc, "cutlass": env.cutlass})
    if recorded != env:
        raise BundleError(f"{path}: the manifest's environment of {name} is not the one its key records; nothing "
                          "imported")
    return Entry(stored, env, list(item["artifacts"]))


# -- import ---------------------------------------------------------------------------------------------------------
@dataclass
class ImportReport:
    imported: list[str] = field(default_factory=list)                 # problem names
    kept: list[str] = field(default_factory=list)                     # a local entry as new or newer
    skipped: list[tuple[str, str]] = field(default_factory=list)      # (problem, why): another environment, ...
    artifacts_written: int = 0
    artifacts_present: int = 0
    notes: list[str] = field(default_factory=list)                    # artifacts not carried: built on first use


def import_bundle(path: Path, partial: bool = False, machine: environment.Here | None = None,
                  settings: dict | None = None) -> ImportReport:
    """Import the bundle at `path` into this cache (see the module docstring). `machine`: the environment to match
    (default: this one); `settings`: this process's fingerprint (kernels.tune.autotune.fingerprint), to note entries
    tuned with other settings, which its lookups would not find."""
    store = SelectionStore(selections_dir())      # first: a cache that failed its checks is refused before any write
    bundle = read_bundle(Path(path))
    if machine is None:
        machine = environment.here(toolchain=any(e.env.nvcc or e.env.cutlass for e in bundle.entries))
    report = ImportReport()
    matching = _matching(Path(path), bundle, machine, partial, report)
    steps: dict[tuple[str, str], Install] = {}
    chosen = []
    for entry in matching:
        sel = entry.stored.selection
        try:
            wanted = needs(sel.problem, sel.winner_choice)
        except ArtifactError as e:
            report.skipped.append((entry.stored.problem_name, f"its winner cannot be built here: {e}"))
            continue
        for need in wanted:
            try:
                step = plan(need, bundle.members)
            except ArtifactError as e:
                raise BundleError(f"{path}: {e}; nothing imported") from e
            if isinstance(step, str):
                report.notes.append(f"{entry.stored.problem_name}: {step} (built on first use)")
            else:
                steps[(need.backend, need.key)] = step
        chosen.append(entry)
    for step in steps.values():
        try:
            written = install(step)
        except (OSError, ArtifactError) as e:
            raise BundleError(f"cannot write {step.need.backend} artifact {step.need.key} into {cache_root()}: "
                              f"{e}") from e
        if written:
            report.artifacts_written += 1
        else:
            report.artifacts_present += 1
    for entry in chosen:
        _put(store, entry.stored, report)
    if settings is not None:
        _note_settings(chosen, settings, report)
    return report


def _matching(path: Path, bundle: Bundle, machine: environment.Here, partial: bool, report: ImportReport):
    differing: dict[tuple[str, str], int] = {}
    matching = []
    for entry in bundle.entries:
        found = environment.differences(entry.env, machine)
        if not found:
            matching.append(entry)
            continue
        for part in found:
            differing[part] = differing.get(part, 0) + 1
        report.skipped.append((entry.stored.problem_name, "; ".join(f"{p}: {w}" for p, w in found)))
    if differing and (not partial or not matching):
        parts = "; ".join(f"{p}: {w}" + (f" ({n} of {len(bundle.entries)} selections)"
                                         if n < len(bundle.entries) else "") for (p, w), n in differing.items())
        hint = f"; `--partial` imports the {len(matching)} that match" if matching else ""
        raise BundleError(f"{path} is for another environment: {parts}. Nothing imported{hint}")
    return matching


def _put(store: SelectionStore, stored: StoredEntry, report: ImportReport) -> None:
    sel = stored.selection
    with store.lock(stored.key):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")          # a bad local entry is replaced, no need to warn about it here
            local = store.get(stored.key)
        if local is not None and local.created >= sel.created:
            report.kept.append(stored.problem_name)
            return
        if not store.write(stored.key, {"selection": sel.to_dict()}):
            raise BundleError(f"cannot write into {store.root} (see the warning); import stopped after "
                              f"{len(report.imported)} selections")
    report.imported.append(stored.problem_name)


def _note_settings(chosen: list[Entry], settings: dict, report: ImportReport) -> None:
    mine = {k: v for k, v in settings.items() if k not in environment.SOFTWARE}
    other = [e for e in chosen if {k: v for k, v in e.stored.env.items() if k not in environment.SOFTWARE} != mine]
    if other:
        theirs = {k: v for k, v in other[0].stored.env.items() if k not in environment.SOFTWARE}
        report.notes.append(f"{len(other)} selections were tuned with other settings ({_settings(theirs)}) than this "
                            f"process's ({_settings(mine)}): lookups find them under those settings only")


def _settings(env: dict) -> str:
    return ", ".join(f"{k} {v if isinstance(v, str) else ','.join(map(str, v))}" for k, v in sorted(env.items()))
