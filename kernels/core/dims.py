"""Dimension names and size-hint lists, parsed one way for `KERNELS_DYNAMIC` (kernels.core.config) and for
`kernels.Dynamic` (kernels.dispatch.dynamic). Pure: no torch, no kernels state."""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

DIMS = ("m", "n", "k")


def parse_dims(value) -> tuple[str, ...]:
    """'m', 'm,k', ('m', 'k'), True (= 'm'), '' / False / None (= static) -> dims in m, n, k order."""
    if value is None or value is False:
        return ()
    if value is True:
        return ("m",)
    names = [s.strip().lower() for s in value.replace(";", ",").split(",")] if isinstance(value, str) \
        else [str(s).strip().lower() for s in value]
    names = [n for n in names if n]
    bad = [n for n in names if n not in DIMS]
    if bad:
        raise ValueError(f"unknown dynamic dimension(s) {bad}; choose among m, n, k")
    return tuple(d for d in DIMS if d in names)


def _hint_list(values: Iterable) -> tuple[int, ...]:
    out = []
    for v in values:
        try:
            as_float = float(v)
            iv = int(as_float) if math.isfinite(as_float) else 0
        except (TypeError, ValueError):
            iv, as_float = 0, math.nan
        if iv < 1 or iv != as_float:
            raise ValueError(f"size hints must be positive integers, got {v!r}")
        out.append(iv)
    if not out:
        raise ValueError("at least one size hint is needed")
    return tuple(sorted(set(out)))


def parse_hints(value) -> tuple[tuple[str, tuple[int, ...]], ...] | tuple[int, ...]:
    """Size hints: '64,256,4096' or (64, 256, 4096) apply to every dynamic dim; 'm=16,64;k=1024,4096' or
    {'m': (16, 64), 'k': (1024, 4096)} give each dim its own. Returns a sorted tuple of ints (every dim) or a
    tuple of (dim, hints) pairs in m, n, k order."""
    if isinstance(value, Mapping):
        pairs = {str(k).strip().lower(): _hint_list(v) for k, v in value.items()}
    elif isinstance(value, str) and "=" in value:
        pairs = {}
        for part in value.split(";"):
            if not part.strip():
                continue
            dim, _, rest = part.partition("=")
            pairs[dim.strip().lower()] = _hint_list(s for s in rest.split(",") if s.strip())
    elif isinstance(value, str):
        return _hint_list(s for s in value.split(",") if s.strip())
    elif isinstance(value, tuple) and value and all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str)
                                                     for p in value):
        pairs = {k.strip().lower(): _hint_list(v) for k, v in value}
    else:
        return _hint_list(value)
    bad = [d for d in pairs if d not in DIMS]
    if bad:
        raise ValueError(f"size hints for unknown dimension(s) {bad}; choose among m, n, k")
    return tuple((d, pairs[d]) for d in DIMS if d in pairs)
