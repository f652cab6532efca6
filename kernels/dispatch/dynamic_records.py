"""Dynamic shapes as records: the `Dynamic` declaration (which dims vary, size hints, mode, buckets), substituting
sizes into a problem, and what dispatch decided (`HintWinner`, `PoolEntry`, `Decision`). Policy is in
kernels/dispatch/dynamic.py and kernels/space/dynamic_rules.py."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.dynamic_spec import DEFAULT_HINTS, hints_for, parse_buckets, parse_dims, parse_hints, parse_mode
from kernels.core.errors import InputTypeError, InputValueError
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection

# -- declaration -----------------------------------------------------------------------------------------------
DEFAULT_MODE = "benchmark"
DEFAULT_BUCKETS = "pow2"
# Benchmark mode: how many of each hint's fastest candidates (its winner first) a new bucket benchmarks. A runtime size
# between two hints is often best served by a hint's runner-up, not by either winner (H100, K=11008, N=4096: the M=256
# hint's 64x128 runner-up ran M=199 and 229 at 1.00x a per-M tune, its aten winner at 1.12x and 1.21x); 3 was not
# compared with other sizes, and each one more per hint is one more candidate timed per new bucket
DYNAMIC_POOL = 3


@dataclass(frozen=True)
class Dynamic:
    """Which dims are dynamic, and how. Fields left None take the defaults (DEFAULT_HINTS, DEFAULT_MODE,
    DEFAULT_BUCKETS, DYNAMIC_POOL). Hashable, so it can be passed on every call."""
    dims: tuple[str, ...] | str = "m"
    hints: tuple | None = None          # (64, 256, 4096) for every dim, or {"m": (...), "k": (...)}
    mode: str | None = None             # "benchmark" | "similarity"
    buckets: str | None = None          # "pow2" | "exact" | "16,64,256"
    pool: int | None = None             # benchmark mode: each hint's fastest candidates a new bucket times

    def __post_init__(self):
        dims = parse_dims(self.dims)
        if not dims:
            raise ValueError("Dynamic needs at least one of m, n, k (pass dynamic=None or False for static)")
        object.__setattr__(self, "dims", dims)
        if self.hints is not None:
            object.__setattr__(self, "hints", parse_hints(self.hints))
            stray = [d for d, _ in self.hints if d not in dims] if self.hints and isinstance(self.hints[0], tuple) \
                else []
            if stray:       # they would be ignored: a dim the caller meant to make dynamic, left out of `dims`
                raise ValueError(f"hints for {', '.join(stray)}, which is not among the dynamic dims {dims}")
        if self.mode is not None:
            object.__setattr__(self, "mode", parse_mode(self.mode))
        if self.buckets is not None:
            object.__setattr__(self, "buckets", parse_buckets(self.buckets))
        if self.pool is not None and (isinstance(self.pool, bool) or not isinstance(self.pool, int) or self.pool < 1):
            raise ValueError(f"pool must be a positive integer, got {self.pool!r}")

    def resolved(self) -> Dynamic:
        """Every field filled (defaults for the ones left None); hints as (dim, hints) pairs for exactly `dims`."""
        hints = hints_for(self.hints if self.hints is not None else DEFAULT_HINTS, self.dims)
        return Dynamic(self.dims, tuple(hints.items()), self.mode or DEFAULT_MODE, self.buckets or DEFAULT_BUCKETS,
                       self.pool or DYNAMIC_POOL)


def resolve(arg) -> Dynamic | None:
    """The resolved declaration for mm's `dynamic=` argument, or None for a static problem.
    None -> kernels.config.dynamic (KERNELS_DYNAMIC); False / '' / () -> static; True -> 'm'; 'm,k' / ('m', 'k') /
    Dynamic."""
    if arg is None:
        declared = config.dynamic            # (a bad KERNELS_DYNAMIC raises its own SettingError, naming it)
        if not declared:
            return None
        own = {d: hints for d, hints in declared if hints}
        return Dynamic(tuple(d for d, _ in declared), hints=own or None).resolved()
    try:
        if isinstance(arg, Dynamic):
            return arg.resolved()
        if isinstance(arg, (bool, str, tuple)):
            dims = parse_dims(arg)
            return Dynamic(dims).resolved() if dims else None
    except ValueError as e:
        raise InputValueError(f"kernels: bad dynamic={arg!r}: {e}") from e
    raise InputTypeError(f"kernels: dynamic= must be None, a bool, a str like 'm' or 'm,k', a tuple of dim names, "
                         f"or kernels.Dynamic (hashable: it is part of the warm dispatch key), got "
                         f"{type(arg).__name__}")


# -- shapes ----------------------------------------------------------------------------------------------------
def _restride(shape: tuple[int, int], stride: tuple[int, int], new: tuple[int, int]) -> tuple[int, int]:
    """The stride the operand would have at the new shape: a unit-stride operand keeps its padding (contiguous
    stays contiguous); anything else keeps its strides."""
    rows, cols = shape
    if stride[1] == 1 and stride[0] >= cols:
        return (stride[0] - cols + new[1], 1)
    if stride[0] == 1 and stride[1] >= rows:
        return (1, stride[1] - rows + new[0])
    return stride


def substitute(problem: GemmProblem, sizes: dict[str, int], dims: tuple[str, ...]) -> GemmProblem:
    """The problem with some of m, n, k replaced (strides follow, see _restride), marked dynamic in `dims`."""
    m, n, k = (sizes.get(d, getattr(problem, d)) for d in ("m", "n", "k"))
    return dataclasses.replace(
        problem, m=m, n=n, k=k, dynamic=tuple(dims),
        stride_a=_restride((problem.m, problem.k), problem.stride_a, (m, k)),
        stride_b=_restride((problem.k, problem.n), problem.stride_b, (k, n)))


def shape_of(p: GemmProblem) -> tuple[int, int, int]:
    return (p.m, p.n, p.k)


def sizes_label(sizes: dict[str, int]) -> str:
    return ",".join(f"{d}={v}" for d, v in sizes.items())


# -- decisions -------------------------------------------------------------------------------------------------
@dataclass
class HintWinner:
    sizes: dict[str, int]              # the hint values, e.g. {"m": 256}
    problem: GemmProblem               # the hint problem that was tuned
    selection: Selection

    @property
    def label(self) -> str:
        return sizes_label(self.sizes)

    @property
    def choice(self) -> Choice:
        return self.selection.winner_choice


@dataclass
class PoolEntry:
    """A tuned choice that may serve runtime shapes: a hint's winner (rank 1) or one of its runners-up."""
    choice: Choice
    hint: HintWinner            # the hint whose tune timed it
    rank: int                   # its place in that tune, 1 = the winner

    @property
    def label(self) -> str:
        return self.hint.label if self.rank == 1 else f"{self.hint.label} #{self.rank}"


@dataclass
class Decision:
    """Which hint winner serves one runtime shape, and why."""
    mode: str
    shape: tuple[int, int, int]
    dims: tuple[str, ...]
    winner: str                                   # choice name that serves the shape
    hint: str           # the hint(s) whose tune it comes from: "m=256" its winner, "m=256 #2" its runner-up
    source: str                 # similarity | benchmarked | stored | memory | only-candidate | own-tune
    bucket: str = ""
    measured_at: tuple[int, int, int] | None = None   # benchmark mode: the shape the bucket was timed on
    distances: dict[str, float] = field(default_factory=dict)   # similarity: hint -> log2 L1 distance
    timings: dict[str, float | str] = field(default_factory=dict)  # benchmark: choice -> ms, or failure
    also_measured: list[str] = field(default_factory=list)         # benchmark: the bucket's edges, "MxNxK"
    worst_ratio: dict[str, float] = field(default_factory=dict)    # benchmark: choice -> worst ratio over them
    hint_winners: dict[str, str] = field(default_factory=dict)  # hint -> its tuned winner
    seconds: float = 0.0                          # runtime benchmark cost (benchmark mode, when it ran here)
    notes: list[str] = field(default_factory=list)

    def why(self) -> str:
        shape = "x".join(map(str, self.shape))
        head = (f"dynamic {','.join(self.dims)}, {self.mode} mode: {shape} served by {self.winner} "
                f"(hint {self.hint}{'' if '#' in self.hint else ' winner'})")
        if self.source == "own-tune":
            head = (f"dynamic {','.join(self.dims)}, {self.mode} mode: {shape} served by {self.winner}, tuned for "
                    f"this shape because no hint winner can run it")
            body = "see the notes"
        elif self.mode == "similarity":
            d = ", ".join(f"{h}: {v:.2f}" for h, v in self.distances.items())
            body = f"nearest hint by log2 L1 distance over A, B, C shapes ({d})"
        else:
            where = {"benchmarked": "benchmarked here", "stored": "decision read from the selection store",
                     "memory": "decided earlier in this process",
                     "only-candidate": "every usable hint candidate is this one, nothing to benchmark"}[self.source]
            at = f" at {'x'.join(map(str, self.measured_at))}" if self.measured_at else ""
            t = ", ".join(f"{n}: {v * 1e3:.1f} us" if isinstance(v, float) else f"{n}: {v}"
                          for n, v in self.timings.items())
            if self.also_measured:
                at += f" and {', '.join(self.also_measured)} (ranked by the worst ratio to the fastest per size)"
            body = f"bucket {self.bucket}, {where}{at}" + (f"; {t}" if t else "")
        hints = "; ".join(f"{h} -> {w}" for h, w in self.hint_winners.items())
        return f"{head}; {body}; hint winners: {hints}" + "".join(f"; {n}" for n in self.notes)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


