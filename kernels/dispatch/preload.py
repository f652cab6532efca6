"""kernels.preload(): ready stored winners before the first calls, as a server does at startup.

A fresh process's first call of a stored problem loads its winner (a Triton module and cubin, a CUTLASS library),
verifies it, and pays the process's one-time costs (importing Triton, its launcher stubs); on the H100 that made the
first Triton-served call of a llama layer ~1.2 s while every later first call took 4–30 ms. preload() moves that work
to a point the caller chooses: every stored selection of the current GPU under the current settings (or only the
listed problems) is loaded and verified now, so each first call is a memory hit. It never tunes, benchmarks or
compiles a candidate: a problem the store lacks is left to its first call (a shared store's winner that is not built
here is built, as its first call would)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kernels.core.config import config
from kernels.core.errors import InputTypeError
from kernels.dispatch import selected
from kernels.store import cache_admin
from kernels.tune.autotune import fingerprint
from kernels.tune.offline import target
from kernels.tune.problem_list import read_all, retarget


@dataclass
class Preloaded:
    loaded: int = 0                  # winners loaded and verified now
    already: int = 0                 # this process had them
    missing: list[str] = field(default_factory=list)     # listed problems with no usable stored entry
    seconds: float = 0.0

    def __str__(self) -> str:
        text = f"preloaded {self.loaded} winners ({self.already} already in memory) in {self.seconds:.2f} s"
        return text + (f"; {len(self.missing)} not stored (their first call tunes)" if self.missing else "")


def preload(problems=None) -> Preloaded:
    """Load and verify stored winners for the current GPU now. `problems`: paths of problem lists or traces (as
    `python -m kernels tune` reads them); None: every entry of the local store for this GPU and these settings."""
    if problems is not None and not (hasattr(problems, "__iter__") or hasattr(problems, "__fspath__")):
        raise InputTypeError(f"preload: problems must be a path or a list of paths to problem lists or traces, not "
                             f"{type(problems).__name__}")
    paths = None
    if problems is not None:
        paths = [problems] if isinstance(problems, (str, bytes)) or hasattr(problems, "__fspath__") else list(problems)
        wrong = [p for p in paths if not isinstance(p, (str, bytes)) and not hasattr(p, "__fspath__")]
        if wrong:
            raise InputTypeError(f"preload: problems must be a path or a list of paths to problem lists or traces; "
                                 f"the list holds a {type(wrong[0]).__name__} ({wrong[0]!r})")
    start = time.perf_counter()
    report = Preloaded()
    where = target()            # the current GPU, or the CPU through the Triton interpreter
    if where is None:
        report.seconds = time.perf_counter() - start
        return report
    device, arch, name = where
    if paths is None:
        here = fingerprint(config.backends)
        good, _ = cache_admin.entries()
        todo = [e.selection.problem for e in good
                if e.env == here and e.selection.problem.device == device and e.selection.problem.device_name == name
                and e.selection.problem.arch == arch and not e.selection.problem.dynamic]
    else:
        todo = [item.problem for item in retarget(read_all(paths), device, arch, name) if not item.problem.dynamic]
    with torch._C.DisableTorchFunction():
        for problem in todo:
            state = selected.load_only(problem)
            if state == "loaded":
                report.loaded += 1
            elif state == "memory":
                report.already += 1
            else:
                report.missing.append(problem.short())
    report.seconds = time.perf_counter() - start
    return report
