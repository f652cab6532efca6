"""The Backend interface and the records that flow out of it."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from backends.child_handle import CHILD_TIMEOUT_S
from backends.isolated_child import run_isolated
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem

# launch(a, b, out) -> out: the call exactly as `kernels.mm` makes it on the warm path (allocates out when None)
LaunchFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


@dataclass
class Runner:
    choice: Choice
    launch: LaunchFn
    isolated: bool = False      # benchmark in a subprocess: a fault must not poison the caller's CUDA context


@dataclass
class BuildOutcome:
    choice: Choice
    runner: Runner | None
    error: str | None = None     # failure text when runner is None
    compiled: bool = False       # True when this build ran a compiler (False: loaded from the artifact store)
    seconds: float = 0.0
    # not built yet, and left to a background build (KERNELS_CUTLASS_BUILD=background): the tune goes on without it
    # and records it in Selection.pending
    pending: bool = False
    # failed for a reason outside the candidate (an OSError reading or writing the cache: a full disk, a folder's
    # mode): the tune records the backend as unavailable, so the next cold lookup tunes again instead of keeping a
    # winner chosen without it for good
    environment: bool = False


class Backend(ABC):
    name: str = ""
    # verify and time this backend's runners in a child process first (backends/isolated_child.py): a kernel that
    # faults poisons the CUDA context it runs in. Costs a child start per tune; CUTLASS's are isolated.
    isolated: bool = False
    # runs problems with an epilogue (GemmProblem.bias / .activation): launch(a, b[, bias], out) computes
    # activation(a @ b + bias); backends without it are left out of such problems' tunes with the reason
    epilogues: bool = False

    @abstractmethod
    def available(self, problem: GemmProblem) -> tuple[bool, str]:
        """Whether this backend can run on the problem's device at all, and why not."""

    @abstractmethod
    def choices(self, problem: GemmProblem, space: str = "default") -> tuple[list[Choice], dict[str, str]]:
        """Supported choices for the problem, and the ones left out with the reason (name -> reason)."""

    @abstractmethod
    def build(self, problem: GemmProblem, choices: list[Choice]) -> list[BuildOutcome]:
        """Build (or load) every choice in one batch. Never raises for a single failing choice."""

    def measure_isolated(self, problem: GemmProblem, runners: list[Runner], budget_ms: float,
                         best_ms: float | None = None, verify_all: bool = False) -> dict:
        """For runners with isolated=True: time and verify each one in a child process (with the same
        kernels.verify / kernels.timing code) and return name -> kernels.timing.Timing (verified),
        backends.isolated_child.Unverified (timed only: no final round could take it), or name -> failure text.
        `best_ms`: the fastest median of the caller's own first pass, which the child's cutoffs start from. A fault
        in the child is a failure for that choice, never an exception here."""

        return run_isolated(self.name, problem, [r.choice for r in runners], budget_ms, CHILD_TIMEOUT_S,
                            best_ms=best_ms, verify_all=verify_all)

    def built(self, problem: GemmProblem, choices: list[Choice]) -> set[str]:
        """Names of the choices whose binaries this backend has stored, so building them compiles nothing. Backends
        that cannot tell cheaply keep the default: none known."""
        return set()

    def settled(self, problem: GemmProblem, choices: list[Choice]) -> bool:
        """Whether choices that were pending when the problem was tuned are settled now: built, or failed for good.
        Asked on a cold lookup of such a problem (cheaply: no binary is read), which re-tunes it once they are.
        Backends that never leave a choice pending keep the default."""
        return True

    def prebuild(self, work: list[tuple[GemmProblem, list[Choice]]]) -> int:
        """Compile ahead, in one batch, the binaries several problems' builds will need; returns how many were
        compiled. Backends whose per-problem builds already use every core keep the default: nothing ahead."""
        return 0

    def close(self) -> None:
        """Release worker processes and other resources."""
