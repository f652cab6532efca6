"""Choice: a backend + template + config. Its `.name` is its identity in logs, caches and lookup tables."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, order=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int
    group_m: int = 8

    def tag(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}_s{self.num_stages}_w{self.num_warps}_g{self.group_m}"

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GemmConfig":
        return cls(**{k: int(v) for k, v in data.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class Choice:
    backend: str                       # "aten", "triton", "cutlass"
    template: str                      # "aten_mm", "triton_mm", ...
    dtype: str                         # input dtype name
    config: GemmConfig | None = None
    params: tuple[tuple[str, object], ...] = field(default=())   # template-specific extras, e.g. (("split", 16),)

    @property
    def name(self) -> str:
        if self.config is None and not self.params:
            return self.template
        parts = [self.template] if self.dtype in self.template else [self.template, self.dtype]
        if self.config is not None:
            parts.append(self.config.tag())
        parts.extend(f"{k}{v}" for k, v in self.params)
        return "_".join(parts)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "template": self.template, "dtype": self.dtype,
                "config": self.config.as_dict() if self.config else None, "params": [list(p) for p in self.params]}

    @classmethod
    def from_dict(cls, data: dict) -> "Choice":
        cfg = GemmConfig.from_dict(data["config"]) if data.get("config") else None
        return cls(backend=data["backend"], template=data["template"], dtype=data["dtype"], config=cfg,
                   params=tuple((k, v) for k, v in data.get("params", [])))


# why a candidate a backend filters itself (before its candidate limit: CUTLASS) was left out, as its `skipped` says
NAME_FILTERED = "left out by KERNELS_ONLY / KERNELS_SKIP"


def name_filter(only: tuple[str, ...], skip: tuple[str, ...]) -> Callable[[str], bool]:
    """A predicate on choice names (KERNELS_ONLY / KERNELS_SKIP): it matches one of `only` (when any) and none of
    `skip` (re.search)."""
    only_re = [re.compile(p) for p in only]
    skip_re = [re.compile(p) for p in skip]

    def keep(name: str) -> bool:
        return (not only_re or any(r.search(name) for r in only_re)) and not any(r.search(name) for r in skip_re)

    return keep
