"""Generated Triton modules are loaded by content: a module's file name carries the hash of its source
(`<template>_<digest>.py`), and a module is executed only from bytes that were read once, hashed and found to match
that name.

Why not import them: an import trusts whatever `__pycache__/*.pyc` sits beside the file (an unchecked hash-based
.pyc is never compared with the source at all), so code planted there would run in every process. Here the verified
bytes are compiled with `compile()` and executed into a fresh module object; nothing is read from `__pycache__` and
nothing is written there.

Triton reads a kernel's source again (inspect.getsourcelines, through linecache) when the @triton.jit decorator runs
and when the interpreter rewrites the kernel; the verified lines are put into linecache first, with no mtime, so
those reads see the bytes that were checked rather than the file as it is by then.

Imports only the standard library: compile workers (backends.triton_worker) load modules through it.
"""
from __future__ import annotations

import contextlib
import hashlib
import linecache
import os
import shutil
import stat
import types
import warnings
from pathlib import Path

DIGEST_CHARS = 20


class GeneratedModuleMismatch(ValueError):
    """A generated module's bytes do not hash to the digest in its file name (truncated, edited or planted)."""


class GeneratedModuleWarning(RuntimeWarning):
    """A generated module on disk failed its content check and was removed (and re-rendered where the source is
    known)."""


def digest(source: bytes) -> str:
    return hashlib.sha256(source).hexdigest()[:DIGEST_CHARS]


def module_file_name(stem: str, source: str) -> str:
    """`<stem>_<digest>.py`: the name a rendered source is stored under."""
    return f"{stem}_{digest(source.encode())}.py"


def expected_digest(path: Path) -> str:
    """The digest a module's file name records; a name that records none has no valid content."""
    stem = path.name[:-3] if path.name.endswith(".py") else ""
    _, _, tail = stem.rpartition("_")
    if len(tail) != DIGEST_CHARS or any(c not in "0123456789abcdef" for c in tail):
        raise GeneratedModuleMismatch(f"{path}: the file name records no content digest")
    return tail


MAX_MODULE_BYTES = 16 << 20     # a rendered kernel is KiBs


def _read(path: Path) -> bytes | None:
    """The file's bytes, or None when it is not there. Anything but a plain file of at most MAX_MODULE_BYTES in its
    place (a symlink, a FIFO -- opened without blocking --, a device, a directory) is GeneratedModuleMismatch."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:    # ELOOP: a symlink where the module should be: not ours
        raise GeneratedModuleMismatch(f"{path}: cannot be read as a plain file ({e})") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MODULE_BYTES:
        os.close(fd)
        raise GeneratedModuleMismatch(f"{path}: not a plain file of at most {MAX_MODULE_BYTES} bytes")
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_MODULE_BYTES + 1)


def _remove(path: Path) -> None:
    """Whatever is at `path`: a file or link, or a directory planted where a module belongs."""
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _reject(path: Path, why: str, rerendered: bool) -> None:
    _remove(path)
    what = "removed and re-rendered" if rerendered else "removed"
    warnings.warn(f"kernels: generated Triton module {path} {why}; {what}", GeneratedModuleWarning, stacklevel=4)


def publish(path: Path, source: str, write) -> None:
    """Make `path` hold exactly `source` (its name must be `module_file_name` of it). A file already there with
    other content is removed, with one warning, and written again; one that matches is left untouched (stable
    mtime). `write(path, text)` is the atomic writer."""
    want = digest(source.encode())
    if expected_digest(path) != want:
        raise ValueError(f"{path} is not the content-addressed name of its source (digest {want})")
    try:
        data = _read(path)
    except GeneratedModuleMismatch as e:
        _reject(path, str(e).removeprefix(f"{path}: "), rerendered=True)
        data = None
    else:
        if data is not None and digest(data) != want:
            _reject(path, "did not match the content hash in its name", rerendered=True)
            data = None
    if data is None:
        write(path, source)


def load(path: Path, name: str) -> types.ModuleType:
    """Execute the module at `path` from its verified bytes into a fresh module object called `name`. A file whose
    bytes do not match its name is removed (one warning) and GeneratedModuleMismatch is raised."""
    path = Path(path)
    want = expected_digest(path)
    try:
        data = _read(path)
    except GeneratedModuleMismatch:
        _remove(path)
        raise
    if data is None:
        raise FileNotFoundError(f"generated Triton module {path} is missing")
    if digest(data) != want:
        _reject(path, "did not match the content hash in its name", rerendered=False)
        raise GeneratedModuleMismatch(f"{path}: content hash {digest(data)} is not the {want} its name records")
    source = data.decode()
    filename = str(path)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    module = types.ModuleType(name)
    module.__file__ = filename
    code = compile(data, filename, "exec", dont_inherit=True)
    exec(code, module.__dict__)  # noqa: S102 - the bytes were just checked against their content hash
    return module


__all__ = ["GeneratedModuleMismatch", "GeneratedModuleWarning", "digest", "load", "module_file_name", "publish"]
