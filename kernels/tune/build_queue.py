"""The queue of background CUTLASS builds: what a tune that lacked CUTLASS kernels asks for (kernels.tune.autotune
calls `request`), and the start of the builder that serves it (kernels.tune.background_build, which describes the
whole mechanism and the files).

Files, under <cache dir>/cutlass/background/:
  requests/<sha256[:32]>.json   one per (problem, choices it lacks); read back validated, a bad one is removed
  builder.lock                  held by the one builder that runs (flock: dropped by the OS when the builder dies)

No request is left behind: a requester writes its request before it looks at the lock, and a builder looks at the
queue again after letting the lock go, so either the builder that held the lock sees the request, or the requester
found the lock free and started a builder.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels.core import detached
from kernels.core.cache_root import cache_root, is_private_fallback
from kernels.core.choice import Choice
from kernels.core.fsutil import file_lock, read_json, write_if_different
from kernels.core.problem import GemmProblem

SCHEMA = 1
BUILDER = "kernels.tune.background_build"
_started: list[subprocess.Popen] = []      # builders this process started (kept so none is reaped early)


@dataclass(frozen=True)
class Where:
    folder: Path

    @classmethod
    def under(cls, root: Path) -> Where:
        return cls(root / "cutlass" / "background")

    @property
    def requests(self) -> Path:
        return self.folder / "requests"

    @property
    def lock(self) -> Path:
        return self.folder / "builder.lock"

    @property
    def state(self) -> Path:
        return self.folder / "state.json"


def where() -> Where:
    return Where.under(cache_root())


@dataclass(frozen=True)
class Request:
    """What one tune lacked: its problem and the CUTLASS choices whose binaries were missing."""
    problem: GemmProblem
    choices: tuple[Choice, ...]

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, "problem": asdict(self.problem),
                           "choices": [c.as_dict() for c in self.choices]}, sort_keys=True)

    @classmethod
    def from_json(cls, data: dict) -> Request:
        """Raises ValueError (or KeyError, TypeError) for anything that is not a request of ours."""
        if data.get("schema") != SCHEMA:
            raise ValueError(f"request schema {data.get('schema')!r} != {SCHEMA}")
        choices = tuple(Choice.from_dict(c) for c in data["choices"])
        if any(c.backend != "cutlass" for c in choices):
            raise ValueError("a request names a choice of another backend")
        return cls(GemmProblem.from_dict(data["problem"]), choices)


def request(problem: GemmProblem, choices: list[Choice]) -> str | None:
    """Queue the choices a tune of `problem` lacks and make sure a builder runs; never waits for it. Returns None, or
    a note for the Selection saying why they will not be built in the background."""
    if is_private_fallback():
        # a build into a temporary cache is gone with this process: minutes of nvcc for nothing
        return ("cutlass: kernels not built, and no background build into the temporary cache this process uses "
                "(the cache directory failed its checks)")
    w = where()
    text = Request(problem, tuple(choices)).to_json()
    try:
        write_if_different(w.requests / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.json", text)
        if not builder_running(w):
            start_builder(w)
    except OSError as e:
        return f"cutlass: the background build could not be queued or started ({e}); the kernels stay unbuilt"
    return None


def builder_running(w: Where) -> bool:
    """Whether a builder holds the lock (it will see every request written before it lets the lock go)."""
    try:
        with file_lock(w.lock, timeout_s=0):
            return False
    except TimeoutError:
        return True


def start_builder(w: Where) -> subprocess.Popen:
    proc = detached.start(BUILDER, json.dumps({"cache": str(w.folder.parents[1])}), wait=False)
    _started.append(proc)
    return proc


def queued(w: Where) -> dict[Path, Request]:
    """The queued requests; one that cannot be read back as a request is removed (a bad file is a miss)."""
    try:
        paths = sorted(w.requests.glob("*.json"))
    except OSError:
        return {}
    found = {}
    for path in paths:
        data = read_json(path)
        try:
            found[path] = Request.from_json(data if data is not None else {})
        except (KeyError, TypeError, ValueError):
            with contextlib.suppress(OSError):
                path.unlink()
    return found
