"""Choice: a backend + template + config. Its `.name` is its identity in logs, caches and lookup tables."""
from __future__ import annotations

from dataclasses import dataclass, field

from kernels.space.heuristics import GemmConfig
from kernels.space.families import TEMPLATE_COMPLEXITY


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

    @property
    def complexity(self) -> int:
        return TEMPLATE_COMPLEXITY.get(self.template, 100)

    def as_dict(self) -> dict:
        return {"backend": self.backend, "template": self.template, "dtype": self.dtype,
                "config": self.config.as_dict() if self.config else None, "params": [list(p) for p in self.params]}

    @classmethod
    def from_dict(cls, data: dict) -> "Choice":
        cfg = GemmConfig.from_dict(data["config"]) if data.get("config") else None
        return cls(backend=data["backend"], template=data["template"], dtype=data["dtype"], config=cfg,
                   params=tuple((k, v) for k, v in data.get("params", [])))
