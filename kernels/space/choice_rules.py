"""What a choice's fields may hold: the parameters templates put in Choice.params and the ranges of a Triton config.
One rule for everything read back (stored selections, bundles, the shared store: kernels.store.schema) and for what
users write (the lookup table: kernels.space.lut). A choice's name and values are rendered into kernel source, so a
value outside these never reaches a template."""
from __future__ import annotations

from kernels.space.heuristics_cutlass import CutlassConfig

# the parameters templates put in Choice.params, with the values they may take
PARAMS = {
    "split": lambda v: _int(v) and 1 <= v <= 4096,                 # split_k / decompose_k
    "sub": lambda v: _int(v) and v in (0, 1),                      # TMA epilogue subtiling
    "": lambda v: isinstance(v, str) and _cutlass_tag(v),          # CUTLASS config tag
}
CONFIG_RANGES = {"block_m": (1, 1024), "block_n": (1, 1024), "block_k": (1, 1024), "num_stages": (1, 16),
                 "num_warps": (1, 32), "group_m": (1, 1024)}


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _cutlass_tag(text: str) -> bool:
    try:
        CutlassConfig.from_tag(text)
        return True
    except (ValueError, TypeError):
        return False


def param_problem(pair) -> str | None:
    """Why `pair` ([name, value]) is not a parameter a template takes, or None."""
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)):
        return f"parameter {pair!r} is not a [name, value] pair"
    if pair[0] not in PARAMS:
        return f"parameter {pair[0]!r} unknown (known: {', '.join(repr(k) for k in PARAMS)})"
    if not PARAMS[pair[0]](pair[1]):
        return f"parameter {pair[0]!r} value {pair[1]!r} out of range"
    return None


def config_problem(cfg) -> str | None:
    """Why `cfg` (field -> value) is not a Triton config in range, or None. group_m may be left out."""
    if not isinstance(cfg, dict) or set(cfg) - set(CONFIG_RANGES):
        return f"config fields must be among {', '.join(CONFIG_RANGES)}"
    for field, (lo, hi) in CONFIG_RANGES.items():
        if field not in cfg and field == "group_m":
            continue
        if not (_int(cfg.get(field)) and lo <= cfg[field] <= hi):
            return f"config {field} = {cfg.get(field)!r} is not an integer in [{lo}, {hi}]"
    return None
