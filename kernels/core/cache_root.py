"""The cache directory is private to its user. Code is loaded from it (generated modules, shared libraries), so
before anything is read from it this process checks it: a directory (not a regular file), not a symbolic link to
elsewhere, owned by this user, not writable by group or others. Missing, it is created 0700. A root that fails gets
one warning saying why, and this process uses a fresh private directory instead: nothing is loaded from the bad one.
"""
from __future__ import annotations

import atexit
import os
import shutil
import stat
import tempfile
import threading
import warnings
from pathlib import Path

from kernels.core.config import config
from kernels.core.fsutil import make_private_dirs


# Written into a cache directory kernels creates (the cache-directory tag convention, which backup tools honour):
# `cache clear` empties a tagged directory, or an untagged one that holds nothing but CACHE_ENTRIES (one made before
# the tag); a folder that was there before, such as a home or a source tree named by mistake, is never tagged
TAG_NAME = "CACHEDIR.TAG"
TAG_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
            "# This directory is a cache of the kernels library (tuned selections and built kernels).\n"
            "# python -m kernels cache clear empties it; everything in it is rebuilt on demand.\n")

# What kernels makes at the top of the cache directory, and who makes it: `cache clear` removes these and nothing else
# (KERNELS_CACHE_DIR may name a folder that holds other things). tests/unit/test_cli_cache_dir.py keeps the list
# complete against the sources.
CACHE_ENTRIES = (
    "selections",   # kernels.store: selections, dynamic bucket decisions
    "triton",       # backends.triton: generated modules, compiled-kernel records, Triton's own cache
    "cutlass",      # backends.cutlass: sources, binaries, batches, the background build's queue
    "fastpath",     # kernels.native: the C++ warm-call table
    "logs",         # kernels.tune.worker_launch: `tune --gpus` worker logs
)


class CacheWarning(UserWarning):
    """The cache could not be used as configured (kernels goes on with a private directory, or from memory)."""


_lock = threading.Lock()
_verified: dict[str, Path] = {}        # configured path -> the directory this process uses for it


def _uid() -> int:
    return os.getuid()


def _lstat(path: Path) -> os.stat_result:
    return os.lstat(path)


def problem_with(path: Path) -> str | None:
    """Why `path` cannot be this user's private cache, or None when it can (creating it if missing)."""
    try:
        if not os.path.lexists(path):
            make_private_dirs(path)
            _tag(path)
        st = _lstat(path)
    except OSError as e:
        return f"cannot be created or read ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)}), not a directory of its own"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid != _uid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _tag(path: Path) -> None:
    """Mark a directory kernels just created as its cache (best effort: an untagged cache only clears more
    cautiously)."""
    try:
        fd = os.open(path / TAG_NAME, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return
    with os.fdopen(fd, "w") as f:
        f.write(TAG_TEXT)


def is_tagged(path: Path) -> bool:
    """Whether kernels created `path` as its cache (its tag file is there, a regular file)."""
    try:
        return stat.S_ISREG(os.lstat(path / TAG_NAME).st_mode)
    except OSError:
        return False


def kernels_own(path: Path) -> bool:
    """Whether `path` is a cache folder kernels made: tagged, or holding nothing but CACHE_ENTRIES (a cache made before
    the tag). What kernels may clear out of the way in it; a user's folder named as the cache by mistake is not."""
    if is_tagged(path):
        return True
    try:
        return all(name in CACHE_ENTRIES for name in os.listdir(path))
    except OSError:
        return False


def cache_root() -> Path:
    """The directory this process keeps its cache in: config.cache_dir when it passes the checks, else (with one
    warning) a private temporary directory, removed when the process exits."""
    configured = str(config.cache_dir)
    with _lock:
        root = _verified.get(configured)
        if root is None:
            why = problem_with(Path(configured))
            if why is None:
                root = Path(configured)
            else:
                root = Path(tempfile.mkdtemp(prefix="kernels-cache-"))       # 0700, ours
                atexit.register(shutil.rmtree, root, True)
                warnings.warn(f"kernels: the cache directory {configured} {why}; this process uses a private "
                              f"temporary cache ({root}) and loads nothing from {configured}", CacheWarning,
                              stacklevel=3)
            _verified[configured] = root
        return root


class ForeignWriterError(OSError):
    """Code in the cache sits where another user could have put it: it is not loaded."""


def foreign_writer(path: Path) -> str | None:
    """Why code at `path` in this process's cache could have been put there by someone else, or None. Walking down
    from the root (which passed its own check; for a path outside the cache, from the folder that holds it): a folder
    of this user's that others cannot enter (no x for group and others: new ones are 0700) closes everything below
    it, whatever the modes there (a tool's umask), as long as no link below leads out of it; before that, each folder
    and `path` itself must be no link, this user's and writable by no group or other -- a binary's marker is written
    beside it, so whoever can write its folder can swap both."""
    root = cache_root()
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:      # a binary built elsewhere (a test's folder): its own folder, then it
        root, parts = Path(path).parent, (Path(path).name,)
    here = root
    closed = False
    for part in ("", *parts):
        here = here / part if part else here
        try:
            st = _lstat(here)
        except FileNotFoundError:
            return None                     # nothing there to load
        except OSError as e:
            return f"{here} cannot be checked ({e.strerror or e})"
        if stat.S_ISLNK(st.st_mode):        # below a closed folder too: a link leads out of it
            return f"{here} is a symbolic link"
        if closed:
            continue
        if st.st_uid != _uid():
            return f"{here} is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return f"{here} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        if stat.S_ISDIR(st.st_mode) and not st.st_mode & (stat.S_IXGRP | stat.S_IXOTH):
            closed = True                   # no one else gets past this folder, unless a link leads out
    return None


def refuse_foreign(path: Path, what: str) -> None:
    """Raise ForeignWriterError (after one warning per folder) when `foreign_writer(path)` says why not to load it."""
    why = foreign_writer(path)
    if why is not None:
        warn_once(f"foreign {Path(path).parent}", f"kernels: not loading {what} {path}: {why}; it fails to load "
                  "(a candidate that never wins) until that is fixed or the folder removed (then it is built again)",
                  stacklevel=3)
        raise ForeignWriterError(f"{what} {path} not loaded: {why}")


_warned: set[str] = set()


def warn_once(key: str, text: str, stacklevel: int = 3) -> None:
    """One CacheWarning per `key` per process: a cache fault repeats on every call, its warning should not."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(text, CacheWarning, stacklevel=stacklevel + 1)


def is_private_fallback() -> bool:
    """Whether this process serves from a temporary cache because the configured one failed its checks (what is
    built there is gone when the process exits)."""
    return str(cache_root()) != str(config.cache_dir)


def forget() -> None:
    """Check again on the next call (tests; a process that changed its cache directory's permissions)."""
    with _lock:
        _verified.clear()
