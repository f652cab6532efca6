"""Dynamic-shape declarations as values: which dims vary, the size hints, the runtime mode and the bucket rule, with
the parsers `kernels.config` and `mm(dynamic=...)` share. Pure: no torch, nothing else from kernels."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

# kernels.core.problem.MAX_DIM (no tensor of ours is that long), not imported: that module imports torch, and the
# settings (which parse hints) are read before torch by the CLI's worker start
MAX_DIM = 1 << 31

DIMS = ("m", "n", "k")
MODES = ("benchmark", "similarity")
# The seed's 64/256/4096, plus 16 (M = 1..31 otherwise came from a 64-row tile or aten, whose cuBLAS kernel ran
# M=12 at 1.6x a per-M tune on the H100), 128 and 1024 (tiles for the ranges in between: with the three seed hints
# the H100 sweeps' similarity worst cases were 1.50x and 1.18x, with these six 1.11x and 1.19x), and 2 (decode sizes:
# below the smallest hint, similarity served M = 1..7 with an aten hint winner, 1.07-1.72x a per-M tune on K=11008,
# N=4096, or with the M=16 hint's 16-row tile, 1.11-1.47x at M = 1..4 when a 16x32 tile had won it)
DEFAULT_HINTS = (2, 16, 64, 128, 256, 1024, 4096)


def parse_dims(value) -> tuple[str, ...]:
    """'m', 'm,k', ('m', 'k'), True (= 'm'), '' / False / None (= static) -> dims in m, n, k order."""
    if value is None or value is False:
        return ()
    if value is True:
        return ("m",)
    if not isinstance(value, (str, tuple, list)):
        raise ValueError(f"dynamic dims must be 'm', 'm,k', a tuple of dim names or True, got {value!r}")
    if isinstance(value, str) and "=" in value:
        raise ValueError(f"{value!r} holds size hints, and this takes dim names only ('m' or 'm,k'); give hints "
                         "with kernels.Dynamic('m', hints=(16, 64)) or KERNELS_DYNAMIC='m=16,64'")
    names = [s.strip().lower() for s in value.replace(";", ",").split(",")] if isinstance(value, str) \
        else [str(s).strip().lower() for s in value]
    names = [n for n in names if n]
    bad = [n for n in names if n not in DIMS]
    if bad:
        raise ValueError(f"unknown dynamic dimension(s) {bad}; choose among m, n, k")
    return tuple(d for d in DIMS if d in names)


def _hint_list(values: Iterable) -> tuple[int, ...]:
    if isinstance(values, (int, float)) or not isinstance(values, Iterable):     # hints=16: a single number
        raise ValueError(f"size hints must be a list of positive integers, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool):         # True is 1 to float(); pool=True is refused as well
            raise ValueError(f"size hints must be positive integers, got {v!r}")
        try:
            as_float = float(v)
            iv = int(as_float) if math.isfinite(as_float) else 0
        except (TypeError, ValueError):
            iv, as_float = 0, math.nan
        if iv < 1 or iv != as_float or iv >= MAX_DIM:
            raise ValueError(f"size hints must be positive integers below {MAX_DIM} (2**31), got {v!r}")
        out.append(iv)
    if not out:
        raise ValueError("at least one size hint is needed")
    return tuple(sorted(set(out)))


def parse_hints(value) -> tuple[tuple[str, tuple[int, ...]], ...] | tuple[int, ...]:
    """Size hints: '64,256,4096' or (64, 256, 4096) apply to every dynamic dim; 'm=16,64;k=1024,4096' or
    {'m': (16, 64), 'k': (1024, 4096)} give each dim its own. Returns a sorted tuple of ints (every dim) or a
    tuple of (dim, hints) pairs in m, n, k order."""
    if isinstance(value, Mapping):
        given = list(value.items())
    elif isinstance(value, str) and "=" in value:
        given = [(dim, [s for s in rest.split(",") if s.strip()])
                 for dim, _, rest in (part.partition("=") for part in value.split(";") if part.strip())]
    elif isinstance(value, str):
        return _hint_list(s for s in value.split(",") if s.strip())
    elif isinstance(value, tuple) and value and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                     for p in value):
        given = list(value)
    else:
        return _hint_list(value)
    dims = [str(d).strip().lower() for d, _ in given]
    twice = sorted({d for d in dims if dims.count(d) > 1})
    if twice:               # a second list would silently replace the first
        raise ValueError(f"size hints for {twice} given twice; list each dimension once")
    pairs = {d: _hint_list(hints) for d, (_, hints) in zip(dims, given)}
    bad = [d for d in pairs if d not in DIMS]
    if bad:
        raise ValueError(f"size hints for unknown dimension(s) {bad}; choose among m, n, k")
    return tuple((d, pairs[d]) for d in DIMS if d in pairs)


def hints_for(hints, dims: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Per-dim hints for these dims: a flat tuple applies to each; a dim without its own list gets the default."""
    if hints and isinstance(hints[0], tuple):
        per = dict(hints)
        return {d: per.get(d, DEFAULT_HINTS) for d in dims}
    return {d: tuple(hints) for d in dims}


def parse_mode(value: str) -> str:
    mode = str(value).strip().lower()
    if mode not in MODES:
        raise ValueError(f"dynamic mode must be one of {MODES}, got {value!r}")
    return mode


class BucketRule:
    """Which runtime sizes share one benchmark-mode decision.

    - 'pow2' (default): (2^(i-1), 2^i], i.e. 3 and 4 share the bucket (2, 4]; 1 is its own bucket.
    - 'exact': every size is its own bucket (benchmark every new size once).
    - '16,64,256' (ascending upper edges): (0, 16], (16, 64], (64, 256], (256, inf).
    """

    def __init__(self, text: str = "pow2"):
        self.text = str(text).strip().lower().replace(" ", "")
        if self.text in ("pow2", "exact"):
            self.edges: tuple[int, ...] = ()
            return
        try:
            edges = tuple(int(s) for s in self.text.split(",") if s)
        except ValueError:
            raise ValueError(f"bucket rule must be 'pow2', 'exact' or ascending upper edges like '16,64,256', "
                             f"got {text!r}") from None
        if not edges or any(e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError(f"bucket edges must be ascending positive integers, got {text!r}")
        self.edges = edges
        self.text = ",".join(map(str, edges))

    def bounds(self, size: int) -> tuple[int, int | None]:
        """(lo, hi]: the bucket holding `size`; hi None means unbounded."""
        if size < 1:
            raise ValueError(f"bucket of a size < 1 ({size})")
        if self.text == "exact":
            return size - 1, size
        if self.text == "pow2":
            hi = 1 << (size - 1).bit_length()
            return (hi // 2 if hi > 1 else 0), hi
        lo = 0
        for edge in self.edges:
            if size <= edge:
                return lo, edge
            lo = edge
        return lo, None

    def label(self, dim: str, size: int) -> str:
        lo, hi = self.bounds(size)
        return f"{dim}∈({lo},{'inf' if hi is None else hi}]"

    def __repr__(self) -> str:
        return f"BucketRule({self.text!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, BucketRule) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)


def parse_buckets(value) -> str:
    return BucketRule(value).text
