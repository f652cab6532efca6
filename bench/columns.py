"""What `--backends` names: whole backends, template groups inside a backend, and the Inductor peer.

A column is filled from the Selection of tuning its backend: the fastest timed candidate whose choice belongs to the
column (the whole backend, or one template group), after the --only/--skip filters.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

BACKENDS = ("aten", "triton", "cutlass", "padded")
INDUCTOR = "inductor"
# template-level names and the backend that generates them; other names starting with these prefixes also work
TEMPLATE_GROUPS = {"triton_mm": "triton", "triton_int8_mm": "triton", "triton_scaled_mm": "triton",
                   "triton_tma": "triton", "decompose_k": "triton", "split_k": "triton", "padded_aten": "padded",
                   "padded_triton": "padded",
                   "cutlass3x": "cutlass", "cutlass2x": "cutlass"}
_PREFIX_BACKEND = (("cutlass", "cutlass"), ("triton_", "triton"), ("padded_", "padded"))
# how the tuner records a candidate it left out because the problem is outside the template (kernels.tune.autotune)
UNSUPPORTED = "unsupported: "


class ColumnError(ValueError):
    """A --backends entry that names nothing we know."""


@dataclass(frozen=True)
class Column:
    name: str        # what the table shows
    kind: str        # "backend" | "template" | "inductor"
    backend: str     # the kernels backend that is tuned for it ("" for inductor)

    def owns(self, choice) -> bool:
        """Whether a Choice (backend/template/name) belongs to this column."""
        if self.kind == "backend":
            return choice.backend == self.backend
        if self.kind == "template":
            return choice.backend == self.backend and (choice.template.startswith(self.name)
                                                       or choice.name.startswith(self.name))
        return False


def _backend_for_template(name: str) -> str | None:
    if name in TEMPLATE_GROUPS:
        return TEMPLATE_GROUPS[name]
    for prefix, backend in _PREFIX_BACKEND:
        if name.startswith(prefix):
            return backend
    return None


def parse_columns(spec: str) -> list[Column]:
    """`aten,triton,cutlass,triton_tma,inductor` -> columns; aten always comes first (it is the baseline)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise ColumnError("--backends is empty")
    cols = [Column("aten", "backend", "aten")]
    for name in names:
        if name == "aten":
            continue
        if name in BACKENDS:
            col = Column(name, "backend", name)
        elif name == INDUCTOR:
            col = Column(name, "inductor", "")
        else:
            backend = _backend_for_template(name)
            if backend is None:
                raise ColumnError(f"unknown backend or template {name!r}; backends: {', '.join(BACKENDS)}, "
                                  f"{INDUCTOR}; templates: {', '.join(TEMPLATE_GROUPS)}")
            col = Column(name, "template", backend)
        if col not in cols:
            cols.append(col)
    return cols


def tuned_backends(columns: list[Column]) -> list[str]:
    """The kernels backends that must be tuned to fill the columns, in column order."""
    return list(dict.fromkeys(c.backend for c in columns if c.kind != "inductor"))


@dataclass(frozen=True)
class NameFilter:
    """--only / --skip: regexes matched (re.search) against choice names. aten is never filtered: it is the
    baseline every speedup is relative to."""
    only: tuple[str, ...] = ()
    skip: tuple[str, ...] = ()

    @classmethod
    def compile(cls, only: list[str] | None, skip: list[str] | None) -> "NameFilter":
        for pattern in (only or []) + (skip or []):
            try:
                re.compile(pattern)
            except re.error as e:
                raise ColumnError(f"bad --only/--skip pattern {pattern!r}: {e}") from e
        return cls(tuple(only or ()), tuple(skip or ()))

    def keeps(self, name: str, backend: str) -> bool:
        if backend == "aten":
            return True
        if self.only and not any(re.search(p, name) for p in self.only):
            return False
        return not any(re.search(p, name) for p in self.skip)


@dataclass
class Pick:
    """The column's best candidate in one Selection, or why there is none."""
    name: str | None
    median_ms: float | None
    failure: str | None = None
    candidates: int = 0
    failed: int = 0
    unsupported: int = 0     # of the failed, those the tuner never built ("unsupported: ...")
    broken: str | None = None  # the failures of candidates that were built (wrong result, crash), summarized


def pick_best(selection_timings: dict, selection_choices: dict, column: Column, flt: NameFilter) -> Pick:
    timed, failures, n = [], [], 0
    for cname, choice in selection_choices.items():
        if not column.owns(choice) or not flt.keeps(cname, choice.backend):
            continue
        n += 1
        t = selection_timings.get(cname)
        if isinstance(t, float):
            timed.append((t, cname))
        else:
            failures.append((cname, str(t) if t is not None else "no result"))
    # candidates that never became Choices (unsupported / build failed) appear only in timings
    for cname, t in selection_timings.items():
        if cname in selection_choices or not isinstance(t, str):
            continue
        if _name_in_column(cname, column) and flt.keeps(cname, column.backend):
            n += 1
            failures.append((cname, t))
    built_failures = [(cname, why) for cname, why in failures if not why.startswith(UNSUPPORTED)]
    unsupported = len(failures) - len(built_failures)
    broken = summarize_failures(built_failures) if built_failures else None
    if timed:
        t, cname = min(timed)
        return Pick(cname, t, None, n, len(failures), unsupported, broken)
    if failures:
        return Pick(None, None, summarize_failures(failures), n, len(failures), unsupported, broken)
    return Pick(None, None, "no candidates" + (" after --only/--skip" if flt.only or flt.skip else ""), 0, 0)


def _name_in_column(cname: str, column: Column) -> bool:
    if column.kind == "template":
        return cname.startswith(column.name)
    if column.backend == "aten":
        return cname.startswith("aten")
    backend = _backend_for_template(cname)
    return backend == column.backend or cname.startswith(column.backend)


def summarize_failures(failures: list[tuple[str, str]]) -> str:
    """One cell of text: the most common failure reason and how many share it."""
    counts: dict[str, int] = {}
    for _, why in failures:
        counts[why] = counts.get(why, 0) + 1
    why, count = max(counts.items(), key=lambda kv: kv[1])
    text = why if len(failures) == 1 else f"{len(failures)} failed, {count}x: {why}"
    return text[:300]
