"""Triton template families. Each turns (problem, choice) into kernel specs and, once those are loaded, into a
launch(a, b, out) function (launch(a, b, bias, out) for a problem with a bias; the fused epilogue is rendered from
the problem by backends.triton_render.epilogue_vars). The backend (backends/triton.py) does the rest: render,
compile, load, cache.

Families are imported on first use so `import backends.triton_worker` (compile workers) stays light.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.families import families_of

# template name -> "module:attribute" of its family object (kernels/space/families.py is the one list)
_MODULES = {f.name: f.implementation for f in families_of("triton")}


class TritonFamily(ABC):
    templates: tuple[str, ...] = ()

    @abstractmethod
    def choices(self, problem: GemmProblem, template: str, space: str) -> tuple[list[Choice], dict[str, str]]:
        """Supported choices of `template` for the problem, and what was left out (name or template -> reason)."""

    @abstractmethod
    def specs(self, problem: GemmProblem, choice: Choice) -> list:
        """The TritonKernelSpecs the choice launches, in launch order."""

    @abstractmethod
    def launcher(self, problem: GemmProblem, choice: Choice, specs: list, handles: list):
        """launch(a, b, out=None) -> out, or launch(a, b, bias, out=None) when problem.bias, using one bound handle
        per spec (backends.triton_launch.kernel_sequence)."""


def templates() -> tuple[str, ...]:
    return tuple(_MODULES)


def family(template: str) -> TritonFamily:
    if template not in _MODULES:
        raise KeyError(f"no Triton family implements {template!r}; known: {', '.join(_MODULES)}")
    module, attr = _MODULES[template].split(":")
    return getattr(importlib.import_module(module), attr)
