"""Which environment a stored selection belongs to, and where it differs from this machine's.

A stored entry's key is (problem, fingerprint): the problem names the GPU and its compute capability, the
fingerprint the kernels, torch, CUDA (torch.version.cuda) and Triton versions and the templates' source hash
(kernels.tune.autotune.fingerprint). So an entry's environment is read from its key, with no GPU needed. Keys written
before the CUDA version joined them lack it: a bundle then records it where the exporting process runs the entry's
torch. A CUTLASS winner's binary adds the nvcc and CUTLASS versions its marker records (a binary's key hashes them, so
another nvcc here would never find it).
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from importlib import metadata

import torch

from backends import get_backend
from kernels.core.problem import GemmProblem
from kernels.core.version import __version__
from kernels.space.families import template_tree_hash

# (field, how a message names it), in the order a difference is reported
PARTS = (("gpu", "GPU"), ("arch", "compute capability"), ("torch", "torch"), ("cuda", "CUDA"), ("triton", "Triton"),
         ("templates", "template sources"), ("kernels", "kernels version"), ("nvcc", "nvcc"),
         ("cutlass", "CUTLASS"))
SOFTWARE = ("torch", "triton", "templates", "kernels")


@dataclass(frozen=True)
class Environment:
    """One entry's environment. Empty strings are unknown (CUDA from a process on another torch) or do not apply
    (nvcc and CUTLASS for a winner that is not a CUTLASS kernel); they are not compared."""
    gpu: str                 # the device name, "cpu" for an interpreter entry
    arch: int                # compute capability as 90; 0 on the CPU
    torch: str
    triton: str
    templates: str
    kernels: str
    cuda: str = ""
    nvcc: str = ""
    cutlass: str = ""

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data) -> Environment:
        """Raises ValueError for anything but the fields above with their types."""
        if not isinstance(data, dict) or set(data) - {f for f, _ in PARTS}:
            raise ValueError(f"an environment is an object of {', '.join(f for f, _ in PARTS)}")
        try:
            env = cls(**data)
        except TypeError as e:
            raise ValueError(f"environment incomplete: {e}") from e
        if type(env.arch) is not int or not all(isinstance(getattr(env, f), str) for f, _ in PARTS if f != "arch"):
            raise ValueError("environment fields have the wrong types")
        return env

    def describe(self) -> str:
        where = "CPU (interpreter)" if self.arch == 0 else f"{self.gpu} (sm{self.arch})"
        parts = [where, f"torch {self.torch}", f"CUDA {self.cuda}" if self.cuda else "", f"Triton {self.triton}",
                 f"templates {self.templates}", f"kernels {self.kernels}",
                 f"nvcc {self.nvcc}" if self.nvcc else "", f"CUTLASS {self.cutlass}" if self.cutlass else ""]
        return ", ".join(p for p in parts if p)


def of_key(key: str, problem: GemmProblem, cuda: str = "", toolchain: dict | None = None) -> Environment:
    """The environment a store key records (kernels.store.selections.store_key). Raises ValueError."""
    try:
        env = json.loads(key)["env"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"the key records no environment ({e})") from e
    if not isinstance(env, dict) or not all(isinstance(env.get(k), str) for k in SOFTWARE):
        raise ValueError("the key's environment lacks a version")
    gpu = problem.device_name if problem.device == "cuda" else "cpu"
    if isinstance(env.get("cuda"), str):
        cuda = env["cuda"]
    return Environment(gpu, problem.arch, env["torch"], env["triton"], env["templates"], env["kernels"], cuda,
                       **(toolchain or {}))


@dataclass(frozen=True)
class Here:
    """This machine: its GPUs (none without one) and software; nvcc and CUTLASS as the CUTLASS backend finds them."""
    gpus: tuple[tuple[str, int], ...]
    torch: str
    cuda: str
    triton: str
    templates: str
    kernels: str
    nvcc: str = ""
    cutlass: str = ""

    def as_dict(self) -> dict:
        return {"gpus": [list(g) for g in self.gpus], "torch": self.torch, "cuda": self.cuda, "triton": self.triton,
                "templates": self.templates, "kernels": self.kernels}


def software() -> dict[str, str]:
    """This installation's versions, as a store key records them."""
    return {"torch": torch.__version__, "cuda": torch.version.cuda or "", "triton": _version("triton"),
            "templates": _templates(), "kernels": __version__}


def here(toolchain: bool = True) -> Here:
    """This machine. `toolchain`: also find nvcc and CUTLASS (what a CUTLASS winner's import compares)."""
    gpus = ()
    if torch.cuda.is_available():
        gpus = tuple((torch.cuda.get_device_name(i), _arch(torch.cuda.get_device_capability(i)))
                     for i in range(torch.cuda.device_count()))
    nvcc = cutlass = ""
    if toolchain:
        tools = get_backend("cutlass").tools
        nvcc, cutlass = (tools.nvcc_version or "") if tools.nvcc else "", tools.cutlass.version if tools.cutlass else ""
    return Here(gpus, **software(), nvcc=nvcc, cutlass=cutlass)


def differences(env: Environment, machine: Here, parts: tuple[str, ...] | None = None) -> list[tuple[str, str]]:
    """(part, 'bundle X, here Y') for each part of `env` that this machine does not match, in PARTS order; `parts`
    limits the comparison. A GPU entry needs a GPU here of the same name and compute capability; unknown values
    (empty strings) are not compared."""
    found = []
    for name, label in PARTS:
        if parts is not None and name not in parts:
            continue
        if name == "gpu":
            found.extend(_device_difference(env, machine))
        elif name != "arch":
            mine, theirs = getattr(machine, name), getattr(env, name)
            if theirs and mine != theirs:
                found.append((label, f"bundle {theirs}, here {mine or 'none'}"))
    return found


def _device_difference(env: Environment, machine: Here) -> list[tuple[str, str]]:
    if env.arch == 0 or (env.gpu, env.arch) in machine.gpus:
        return []
    same_name = [a for n, a in machine.gpus if n == env.gpu]
    if same_name:
        return [("compute capability", f"bundle sm{env.arch}, here sm{same_name[0]}")]
    listed = ", ".join(f"{n} (sm{a})" for n, a in machine.gpus) or "no GPU"
    return [("GPU", f"bundle {env.gpu} (sm{env.arch}), here {listed}")]


def _arch(capability: tuple[int, int]) -> int:
    return capability[0] * 10 + capability[1]


@functools.cache
def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"         # as kernels.tune.autotune.fingerprint records it


@functools.lru_cache(maxsize=1)
def _templates() -> str:
    return template_tree_hash()
