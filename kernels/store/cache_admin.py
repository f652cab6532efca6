"""`python -m kernels cache list | show | verify | prune | clear`: what the cache holds, whether it is intact, and
removing what is no longer wanted. Reads never follow links and never load code; removals take the lock the
writers of the same entry take, so a running process sees an entry or a miss, never half of one."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from backends import triton_modules
from kernels.core.cache_root import CACHE_ENTRIES, TAG_NAME, cache_root, is_private_fallback, is_tagged, problem_with
from kernels.core.config import config
from kernels.core.fsutil import ATOMIC_TEMP, file_lock, is_dir_no_link, marker_valid
from kernels.core.selection import Selection
from kernels.native.fastpath_build import BuildPaths
from kernels.store import environment
from kernels.store.buckets import BucketStore, bad_buckets
from kernels.store.schema import problems
from kernels.store.selections import SelectionStore, store_key
from kernels.store.winner_artifacts import (
    CACHE_GROUP,
    read_plain,
    triton_folder,
    triton_record_intact,
)

KEY_PREFIX_CHARS = 12       # what `cache list` shows of an entry's name
UNKNOWN_WHEN = f"{'unknown':16s}"      # as wide as a date, so the columns stay aligned


class CacheAdminError(Exception):
    """A cache command cannot do what was asked (the message says why; nothing was changed)."""


@dataclass
class StoredEntry:
    """A stored selection that passed every check: its file, the bytes read, its key and what they hold."""
    path: Path
    raw: bytes
    key: str
    selection: Selection
    env: dict                    # the fingerprint half of the key

    @property
    def key_id(self) -> str:
        """The entry's file name without .json: sha256 of its key, what `show` and `export --problems` take."""
        return self.path.stem

    @property
    def problem_name(self) -> str:
        return self.selection.problem.short()

    def environment(self, cuda: str = "", toolchain: dict | None = None) -> environment.Environment:
        return environment.of_key(self.key, self.selection.problem, cuda, toolchain)


@dataclass
class BadFile:
    what: str                    # "selection", "bucket decisions", "Triton build", ...
    path: Path
    why: str


def root() -> Path:
    """The cache this process uses; CacheAdminError when the configured one failed its checks (kernels would use a
    temporary directory instead: nothing to list, and nothing to import into that would outlive this command)."""
    used = cache_root()
    if is_private_fallback():
        why = problem_with(Path(str(config.cache_dir))) or "failed its checks"
        raise CacheAdminError(f"the cache directory {config.cache_dir} {why}; nothing done")
    return used


def selections_dir() -> Path:
    return root() / SelectionStore.subdir


def parse_entry(raw: bytes, name: str) -> StoredEntry | str:
    """The entry a selection file holds, or why it is not one: a JSON object for exactly the key its name hashes,
    a selection the store's schema accepts (data, never code), and a key whose problem is the selection's own."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        return f"not JSON ({type(e).__name__})"
    if not isinstance(data, dict) or not isinstance(data.get("key"), str):
        return "not a selection entry"
    key = data["key"]
    if f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json" != name:
        return "its name is not its key's hash"
    why = problems(data.get("selection"))
    if why:
        return why
    try:
        selection = Selection.from_dict(data["selection"], source="disk")
        env = json.loads(key)["env"]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        return f"malformed ({type(e).__name__}: {e})"
    if not isinstance(env, dict) or store_key(selection.problem, env) != key:
        return "its key is not the selection's problem and an environment"
    try:
        environment.of_key(key, selection.problem)
    except ValueError as e:
        return str(e)
    return StoredEntry(Path(name), raw, key, selection, env)


def entries() -> tuple[list[StoredEntry], list[BadFile]]:
    """Every stored selection, oldest first, and the files in the store that are not one."""
    good, bad = [], []
    for path in _files(selections_dir(), ".json"):
        try:
            found = parse_entry(read_plain(path), path.name)
        except OSError as e:
            found = f"unreadable ({e.strerror or e})"
        if isinstance(found, str):
            bad.append(BadFile("selection", path, found))
        else:
            found.path = path
            good.append(found)
    good.sort(key=lambda e: (e.selection.created, e.key_id))
    return good, bad


def _files(folder: Path, suffix: str) -> list[Path]:
    """The names in `folder` ending in `suffix` (links included: the readers refuse them), none when it is missing."""
    try:
        with os.scandir(folder) as it:
            return sorted(Path(e.path) for e in it if e.name.endswith(suffix) and not e.name.startswith(".")
                          and not e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):     # a plain file where the folder belongs: verify names it
        return []


def _awaiting(sel) -> str:
    """What a listed entry still waits for on the calls, if anything."""
    if sel.unmeasured:
        return (f" ({len(sel.unmeasured)} candidate(s) to measure on calls"
                + (f", then a duel with {sel.duel} or the fastest of them)" if sel.duel else ", then a duel)"))
    return f" (duel with {sel.duel} pending on calls)" if sel.duel else ""


def list_lines() -> list[str]:
    good, bad = entries()
    lines = [f"{e.key_id[:KEY_PREFIX_CHARS]}  {_when(e.selection.created)}  {e.selection.regime:6s}  "
             f"{e.problem_name}  -> {e.selection.winner}"
             + _awaiting(e.selection) for e in good]
    if bad:
        lines.append(f"({len(bad)} unreadable or invalid entries: `python -m kernels cache verify`)")
    return lines


def _when(created: float) -> str:
    """The date as `cache list` shows it; "unknown" for 0 or a value no clock can show (never raises: a listing must
    not die on one odd entry)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(created)) if created else UNKNOWN_WHEN
    except (OverflowError, OSError, ValueError, TypeError):
        return UNKNOWN_WHEN


def find(prefix: str) -> StoredEntry:
    """The one stored selection whose key id starts with `prefix`; CacheAdminError when none or several do."""
    prefix = prefix.strip().lower()
    if not prefix:
        raise CacheAdminError("no key given")
    good, bad = entries()
    matches = [e for e in good if e.key_id.startswith(prefix)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise CacheAdminError(f"key prefix {prefix!r} is ambiguous: " +
                              ", ".join(e.key_id[:KEY_PREFIX_CHARS] for e in matches[:8]))
    broken = [b for b in bad if b.path.stem.startswith(prefix)]
    if broken:
        raise CacheAdminError(f"{broken[0].path} is not a usable selection: {broken[0].why}")
    raise CacheAdminError(f"no stored selection has a key starting with {prefix!r} (`python -m kernels cache list`)")


def show_text(prefix: str) -> str:
    entry = find(prefix)
    env = entry.env
    settings = ", ".join(f"{k} {v if isinstance(v, str) else ','.join(map(str, v))}" for k, v in sorted(env.items())
                         if k not in environment.SOFTWARE)
    return "\n".join([entry.selection.table(), f"key:         {entry.key_id}  ({entry.path})",
                      f"environment: {entry.environment().describe()}", f"settings:    {settings}"])


# -- verify ---------------------------------------------------------------------------------------------------------
@dataclass
class VerifyReport:
    checked: dict[str, int] = field(default_factory=dict)
    bad: list[BadFile] = field(default_factory=list)
    removed: int = 0


def verify(fix: bool = False) -> VerifyReport:
    """Check every selection, bucket-decision file, Triton build record and module, CUTLASS binary and fastpath
    library against its own check (the one a load applies). `fix`: remove what fails, so it is built again."""
    base = root()
    report = VerifyReport()
    checks = [("selection", _check_selections), ("bucket decisions", _check_buckets),
              ("Triton build", _check_triton_records), ("Triton module", _check_triton_modules),
              ("CUTLASS binary", _check_cutlass), ("fastpath library", _check_fastpath), ("paths (no links)", _check_links)]
    for what, check in checks:
        count, bad = check(base)
        report.checked[what] = count
        for path, why, remove in bad:
            report.bad.append(BadFile(what, path, why))
            if fix and remove():
                report.removed += 1
    return report


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def _check_selections(base: Path):
    good, bad = entries()
    found = [(b.path, b.why, lambda p=b.path: _unlink(p)) for b in bad]
    strays = _in_the_way(base / SelectionStore.subdir, ".json")
    return len(good) + len(bad) + len(strays), found + strays


def _in_the_way(folder: Path, suffix: str) -> list:
    """A plain file (or a link) where the store's folder belongs, or directories named like its files: every write
    there fails. Writers remove these themselves (KeyedJsonStore.clear_the_way); verify names them, --fix removes."""
    if os.path.lexists(folder) and not is_dir_no_link(folder):
        return [(folder, "not a folder, where the store's folder belongs", lambda p=folder: _unlink(p))]
    return [(path, "a directory, where an entry's file belongs", lambda p=path: _rmtree(p))
            for path in _dirs(folder, "") if path.name.endswith(suffix)]


def _rmtree(path: Path) -> bool:
    if not is_dir_no_link(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def _check_buckets(base: Path):
    store = BucketStore()
    files = _files(base / BucketStore.subdir, ".json")
    bad = []
    for path in files:
        try:
            data = json.loads(read_plain(path))
            ok = isinstance(data, dict) and isinstance(data.get("key"), str) and store.path(data["key"]) == path
        except (OSError, ValueError, UnicodeDecodeError, RecursionError):
            ok = False
        # a malformed bucket is dropped by the reader (re-benchmarked); --fix removes the file, so all its buckets are
        why = "unreadable, or not the decisions of the key its name hashes" if not ok else \
            "; ".join(bad_buckets(data)[:3])
        if why:
            bad.append((path, why, lambda p=path: _unlink(p)))
    strays = _in_the_way(base / BucketStore.subdir, ".json")
    return len(files) + len(strays), bad + strays


def _check_triton_records(base: Path):
    files = _files(base / "triton" / "artifacts", ".json")
    bad = []
    for path in files:
        why = triton_record_intact(path)
        if why:
            bad.append((path, why, lambda p=path: _remove_triton_build(base, p)))
    return len(files), bad


def _remove_triton_build(base: Path, record: Path) -> bool:
    """The record and the cache folder it names: a compile that finds the folder would reuse its bad files."""
    with contextlib.suppress(OSError, ValueError, UnicodeDecodeError, AttributeError):
        group = json.loads(read_plain(record)).get("cache_group")
        folder = triton_folder(group) if isinstance(group, str) and CACHE_GROUP.fullmatch(group) else None
        if folder is not None and stat.S_ISDIR(os.lstat(folder).st_mode):
            shutil.rmtree(folder)
    return _unlink(record)


def _check_triton_modules(base: Path):
    files = _files(base / "triton" / "src", ".py")
    bad = []
    for path in files:
        try:
            ok = triton_modules.digest(read_plain(path)) == triton_modules.expected_digest(path)
        except (OSError, triton_modules.GeneratedModuleMismatch):
            ok = False
        if not ok:
            bad.append((path, "its content does not hash to its name", lambda p=path: _unlink(p)))
    return len(files), bad


def _check_cutlass(base: Path):
    """Binaries with a marker. One without is not built (a build in progress publishes its marker last): a miss."""
    count, bad = 0, []
    for arch_dir in _dirs(base / "cutlass", "sm"):
        for folder in _dirs(arch_dir, ""):
            marker, binary = folder / "meta.json", folder / "kernel.so"
            if not os.path.lexists(marker):
                continue
            count += 1
            if not marker_valid(binary, marker, folder.name):
                bad.append((binary, "does not match its marker (meta.json)",
                            lambda f=folder: _remove_cutlass(base, f)))
    return count, bad


def _remove_cutlass(base: Path, folder: Path) -> bool:
    with file_lock(base / "cutlass" / "build.lock"):
        if marker_valid(folder / "kernel.so", folder / "meta.json", folder.name):
            return False               # rebuilt meanwhile
        removed = _unlink(folder / "meta.json")
        _unlink(folder / "kernel.so")
        return removed


def _check_fastpath(base: Path):
    count, bad = 0, []
    for folder in _dirs(base / "fastpath", ""):
        where = BuildPaths.under(folder, folder.name)
        if not os.path.lexists(where.library):
            continue
        count += 1
        if not marker_valid(where.library, where.marker, where.key):
            bad.append((where.library, "does not match its marker", lambda w=where: _remove_fastpath(w)))
    return count, bad


def _remove_fastpath(where: BuildPaths) -> bool:
    try:
        with file_lock(where.lock, timeout_s=0):        # a build running now publishes it: leave it to that build
            if marker_valid(where.library, where.marker, where.key):
                return False
            _unlink(where.marker)
            return _unlink(where.library)
    except TimeoutError:
        return False


def _check_links(base: Path):
    """Nothing in the cache is a symbolic link; one is not followed by any reader, and removed by --fix."""
    count, bad = 0, []
    for folder, dirs, files in os.walk(base, followlinks=False):
        for name in dirs + files:
            path = Path(folder) / name
            count += 1
            if os.path.islink(path):
                bad.append((path, f"a symbolic link (to {os.readlink(path)}): nothing in the cache is one", lambda p=path: _unlink(p)))
    return count, bad


def _dirs(folder: Path, prefix: str) -> list[Path]:
    try:
        with os.scandir(folder) as it:
            return sorted(Path(e.path) for e in it if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return []


# -- prune and clear --------------------------------------------------------------------------------------------------
@dataclass
class PruneReport:
    removed: list[str] = field(default_factory=list)       # problem names
    kept: int = 0
    logs_removed: int = 0                                   # `kernels tune --gpus` worker logs older than the cutoff
    temporaries_removed: int = 0                            # killed writers' temporaries in the store, as old


# the logs `kernels tune --gpus` keeps of workers that died (kernels.tune.on_gpus), under <cache>/logs
WORKER_LOGS = "tune-gpu*.log"


def prune(older_than_days: float | None = None, stale: bool = False) -> PruneReport:
    """Remove stored selections tuned more than `older_than_days` ago, and (`stale`) those recorded for another
    torch, Triton, kernels version or template sources than this installation's. Only selections: artifacts are
    shared (one binary serves several problems and candidates, warmup builds them with no selection, dynamic bucket
    decisions name winners of their own), so no selection's absence says an artifact is unused."""
    if older_than_days is None and not stale:
        raise CacheAdminError("say what to prune: --older-than DAYS and/or --stale")
    cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
    machine = environment.here(toolchain=False) if stale else None
    store = SelectionStore(selections_dir())
    report = PruneReport()
    good, _ = entries()
    for entry in good:
        with store.lock(entry.key):
            current = store.get(entry.key)          # re-read under the lock: a re-tune may have replaced it
            if current is not None and _prunable(entry, current, cutoff, machine):
                if _unlink(entry.path):
                    report.removed.append(entry.problem_name)
                continue
        report.kept += 1
    if cutoff is not None:
        report.logs_removed = _prune_logs(root() / "logs", cutoff)
        report.temporaries_removed = _prune_temporaries(selections_dir(), cutoff)
    return report


def _prune_temporaries(folder: Path, cutoff: float) -> int:
    """Atomic-write temporaries (fsutil.ATOMIC_TEMP) in the store last written before the cutoff: a write takes
    milliseconds, so one that old was left by a writer killed before its rename. Plain files only; links are not
    followed into other folders."""
    removed = 0
    for where, _, names in os.walk(folder, followlinks=False):
        for name in names:
            path = Path(where) / name
            try:
                info = os.lstat(path)
                if (ATOMIC_TEMP.fullmatch(name) and stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff
                        and _unlink(path)):
                    removed += 1
            except OSError:
                continue
    return removed


def _prune_logs(folder: Path, cutoff: float) -> int:
    """Worker logs last written before the cutoff (a plain file only: never what a link points to)."""
    removed = 0
    for path in folder.glob(WORKER_LOGS) if folder.is_dir() else ():
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_mtime < cutoff and _unlink(path):
                removed += 1
        except OSError:
            continue
    return removed


def _prunable(entry: StoredEntry, current: Selection, cutoff: float | None, machine) -> bool:
    if cutoff is not None and current.created < cutoff:
        return True
    return machine is not None and bool(environment.differences(entry.environment(), machine, environment.SOFTWARE))


class NotACacheError(CacheAdminError):
    """The cache directory was not made by kernels and holds other things: `cache clear` touches nothing there."""


def clear() -> int:
    """Remove what kernels made in the cache directory (CACHE_ENTRIES; the directory and its tag stay): how many
    top-level entries were removed. KERNELS_CACHE_DIR may name a folder that holds other things (a home, a source tree
    with its own `cutlass` or `triton`), so a directory kernels did not create (no tag) is cleared only when it holds
    nothing else; otherwise NotACacheError names what is there. Processes running meanwhile see misses and rebuild
    what they need; an entry another process removes first is not an error. One that cannot be removed raises
    OSError naming it."""
    base = root()
    with os.scandir(base) as it:
        names = sorted(e.name for e in it)
    tagged = is_tagged(base)
    # a tag that is not a regular file (a link, a folder) is not kernels' and counts as something else there, as
    # kernels_own (what the store may clear) counts it
    others = [n for n in names if n not in CACHE_ENTRIES and not (n == TAG_NAME and tagged)]
    if others and not tagged:
        raise NotACacheError(f"{base} was not created by kernels (no {TAG_NAME}) and holds {len(others)} other "
                             f"entries ({', '.join(others[:5])}{' ...' if len(others) > 5 else ''}): nothing removed; "
                             "is KERNELS_CACHE_DIR right? (remove its selections, triton, cutlass, fastpath and logs "
                             "by hand if it is)")
    removed = 0
    for name in names:
        if name not in CACHE_ENTRIES:
            continue
        path = base / name
        try:
            if stat.S_ISDIR(os.lstat(path).st_mode):
                # never follows a link inside (it removes the link); what another process removes meanwhile is
                # skipped, and whatever could not be removed is named below
                shutil.rmtree(path, ignore_errors=True)
                if os.path.lexists(path):
                    raise OSError(errno.EACCES, "could not be removed entirely", str(path))
            else:
                os.unlink(path)
        except FileNotFoundError:
            continue                          # another clear or a pruning process got there first
        removed += 1
    return removed
