"""Compile and publish the C++ warm-call table: at most one build per library at a time, and nothing half-built left
where a loader looks.

`python -m kernels.native.fastpath_build JOB` runs one build job (a BuildJob as JSON) in its own session: the
process that starts it never waits for it to finish, and a build started by a process that exits at once still
publishes. Imports no torch (the job carries the compile command), so a builder that finds the library already
published, or waits on another builder's lock, costs little.

One build: take the lock beside the library (other builders wait on it, then find the library published), remove
temporaries that dead builders left, compile into `.<module>.tmp.<pid>.so` in the library's folder (the compiler in
its own process group, killed as a group if the build is interrupted), os.replace it into place and write the marker
last (size and sha256, kernels.core.fsutil.publish_marker). A library is loaded only when its marker vouches for
it, so a truncated or foreign file never reaches dlopen.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kernels.core.detached import alive, exit_on_signals, run_in_group
from kernels.core.fsutil import (ATOMIC_TEMP, atomic_write_text, file_lock, load_or_build, marker_valid,
                                 publish_marker, read_regular)

MODULE_NAME = "_kernels_fastpath"
OUTPUT = "{output}"             # where the compile command names its output file
BUILD_TIMEOUT_S = 600
# a failed build is tried again (by the next process that wants the table) once this old: a day, so a broken compiler
# costs one background build a day, and a failure of the machine's own does not last for good
FAILED_RETRY_S = 24 * 3600.0
# a failed build's log holds a message, the command and the compiler's last 20000 characters
MAX_NOTE_BYTES = 1 << 20
# temporaries a build leaves only when killed: the compiler's output, and fsutil's atomic-write temp of the marker
_TEMPORARY = re.compile(r"\." + re.escape(MODULE_NAME) + r"\.(?:tmp\.)?(?P<pid>\d+)(?:\.[0-9a-f]+)?\.so"
                        r"|" + ATOMIC_TEMP.pattern)


class FastpathBuildError(RuntimeError):
    """The C++ table did not build; carries the command and the compiler's output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


@dataclass(frozen=True)
class BuildPaths:
    """Where one library (one torch/Python/source/compiler tag) lives, and the files that go with it."""
    folder: Path
    key: str                # the tag: what the marker must record
    library: Path
    marker: Path            # written last by a build: the library's size and sha256
    lock: Path              # held by the one build that runs
    failed: Path            # a failed build's message (not retried until forced or FAILED_RETRY_S old)
    log: Path

    @classmethod
    def under(cls, folder: Path, key: str) -> BuildPaths:
        return cls(folder, key, folder / f"{MODULE_NAME}.so", folder / f"{MODULE_NAME}.marker.json",
                   folder / "build.lock", folder / "FAILED", folder / "build.log")


@dataclass(frozen=True)
class BuildJob:
    where: BuildPaths
    command: tuple[str, ...]        # the compile command; OUTPUT stands for the output file
    force: bool = False             # build even after a failed build

    def to_json(self) -> str:
        return json.dumps({"folder": str(self.where.folder), "key": self.where.key, "command": list(self.command),
                           "force": self.force})

    @classmethod
    def from_json(cls, text: str) -> BuildJob:
        data = json.loads(text)
        return cls(BuildPaths.under(Path(data["folder"]), data["key"]), tuple(data["command"]), bool(data["force"]))


def published(where: BuildPaths) -> Path | None:
    """The library when its marker vouches for it (this tag, same size and sha256), else None."""
    return where.library if marker_valid(where.library, where.marker, where.key) else None


def run(job: BuildJob) -> Path:
    """Build and publish the library unless it is published already; returns its path. Other builders of the same
    library wait on the lock and then find it published. Raises FastpathBuildError (the failure is recorded in
    FAILED and the log) or TimeoutError (another build held the lock too long)."""
    return load_or_build(lambda: published(job.where), lambda: file_lock(job.where.lock, BUILD_TIMEOUT_S),
                         lambda: _build(job))


def failed_lately(where: BuildPaths) -> bool:
    """Whether a build failed less than FAILED_RETRY_S ago: then it is not tried again unless forced. Older, it is:
    what failed may have been the machine's (a full disk, a killed compiler), not the source's."""
    try:
        return time.time() - os.stat(where.failed).st_mtime < FAILED_RETRY_S
    except OSError:
        return False


def _build(job: BuildJob) -> Path:
    where = job.where
    if failed_lately(where) and not job.force:
        raise FastpathBuildError(f"an earlier build failed; log: {where.log}", read_note(where.log))
    remove_stale_temporaries(where.folder)
    tmp = where.folder / f".{MODULE_NAME}.tmp.{os.getpid()}.so"
    command = [tmp.as_posix() if part == OUTPUT else part for part in job.command]
    if shutil.which(command[0]) is None:
        _fail(where, f"C++ compiler {command[0]!r} not found (set CXX)", "")
    try:
        try:
            returncode, output = run_in_group(command, BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            _fail(where, f"compile timed out after {BUILD_TIMEOUT_S} s", " ".join(command))
            raise AssertionError("unreachable") from e
        if returncode != 0 or not tmp.is_file():
            _fail(where, f"compile failed (exit {returncode})", " ".join(command) + "\n" + output[-20000:])
        os.chmod(tmp, 0o700)                # private like the rest of the cache, whatever the umask
        with contextlib.suppress(FileNotFoundError):
            where.marker.unlink()           # a library replaced under an old marker is not vouched for
        os.replace(tmp, where.library)
        publish_marker(where.library, where.marker, where.key, {"command": command})
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(FileNotFoundError):
        where.failed.unlink()
    return where.library


def remove_stale_temporaries(folder: Path) -> None:
    """Remove what builds that died left in the folder: temporaries whose writer (the pid in the name) is gone."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        match = _TEMPORARY.fullmatch(name)
        if match is None:
            continue
        pid = int(match["pid"] or match["writer"])
        if pid == os.getpid() or not alive(pid):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(folder / name)


def _fail(where: BuildPaths, message: str, log: str):
    """Record the failure beside the library (not retried until forced) and raise. A folder that is gone (a
    process's temporary cache, removed when it exited) is not made again."""
    if where.folder.is_dir():
        with contextlib.suppress(OSError):
            atomic_write_text(where.log, f"{message}\n{log}")
            atomic_write_text(where.failed, message + "\n")
    raise FastpathBuildError(f"{message}; log: {where.log}", log)


def read_note(path: Path) -> str:
    """A failed build's log or FAILED message, or "" when it is missing, not a regular file (a FIFO there is never
    waited on, a device never read endlessly) or over MAX_NOTE_BYTES: it only adds detail to an error."""
    try:
        return read_regular(path, MAX_NOTE_BYTES).decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    """Exit 0 when the library is published (by this build or another), 1 when the build failed, 2 when another
    build held the lock past the timeout."""
    exit_on_signals()
    job = BuildJob.from_json(argv[1])
    try:
        run(job)
    except FastpathBuildError as e:
        print(f"fastpath build failed: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:
        print(f"fastpath build: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
