"""What a stored Selection may hold. Everything read back from disk is data to check, never trusted: types,
ranges, known templates and parameter names, and that each choice's name is what its fields spell. A file that
fails is ignored (the problem is re-tuned); `problems()` says why, for the warning."""
from __future__ import annotations

import math
import time

from kernels.core.choice import Choice, GemmConfig
from kernels.core.problem import ACTIVATIONS, DTYPES_BY_NAME, MAX_DIM, OPS, SCALINGS
from kernels.core.selection import SCHEMA_VERSION
from kernels.space.choice_rules import config_problem, param_problem
from kernels.space.families import BY_NAME

DIMS = ("m", "n", "k")
PRECISIONS = ("", "ieee", "tf32")
ALIGNMENTS = (1, 2, 4, 8, 16)
# How far past this machine's clock a selection's `created` may lie: a day covers clocks set wrong by a time zone or
# drifted between machines. Further is no real tune's date, and newer-wins merges (redis publish, bundle import) would
# keep such an entry over every later tune, forever
MAX_CREATED_AHEAD_S = 86400.0


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def finite_non_negative(v) -> bool:
    """A finite int or float (not a bool) of at least 0: a time, a ratio."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def valid_timings(timings) -> bool:
    """name -> ms or the failure's text; a time is a measured call, never 0 (ratios and tables divide by it)."""
    return isinstance(timings, dict) and all(isinstance(t, str) or (finite_non_negative(t) and t > 0)
                                             for t in timings.values())


def _problem(p) -> str | None:
    if not isinstance(p, dict):
        return "problem is not an object"
    if not isinstance(p.get("op"), str) or p["op"] not in OPS:
        return f"unknown op {p.get('op')!r}"
    for d in DIMS:
        if not (_int(p.get(d)) and 0 <= p[d] < MAX_DIM):
            return f"problem.{d} is not a size"
    for key in ("dtype", "out_dtype"):
        if not isinstance(p.get(key), str) or p[key] not in DTYPES_BY_NAME:
            return f"problem.{key} {p.get(key)!r} is not a dtype"
    for key in ("stride_a", "stride_b"):
        s = p.get(key)
        if not (isinstance(s, list) and len(s) == 2 and all(_int(x) and 0 <= x < MAX_DIM for x in s)):
            return f"problem.{key} is not two strides"
    if not all(_int(p.get(k)) and p[k] in ALIGNMENTS for k in ("align_a", "align_b")):
        return "problem alignment is not 1, 2, 4, 8 or 16"
    if not isinstance(p.get("device"), str) or p["device"] not in ("cuda", "cpu") or not (_int(p.get("arch")) and 0 <= p["arch"] < 1000):
        return "problem device/arch unknown"
    if not isinstance(p.get("device_name"), str) or not isinstance(p.get("precision", ""), str) \
            or p.get("precision", "") not in PRECISIONS:
        return "problem device name or precision malformed"
    dyn = p.get("dynamic", [])
    if not (isinstance(dyn, list) and all(isinstance(d, str) and d in DIMS for d in dyn)):
        return "problem.dynamic malformed"
    if not isinstance(p.get("bias", False), bool):
        return "problem.bias is not a boolean"
    if p.get("activation", "") not in ("", *ACTIVATIONS):
        return f"problem.activation {p.get('activation')!r} unknown"
    if p["dtype"] not in OPS[p["op"]]:
        return f"problem.dtype {p['dtype']!r} is not one of {p['op']}'s"
    if (p.get("scaling", "") in SCALINGS) != (p["op"] == "scaled_mm"):
        return f"problem.scaling {p.get('scaling')!r} does not fit op {p['op']}"
    extra = set(p) - {"op", *DIMS, "dtype", "out_dtype", "stride_a", "stride_b", "align_a", "align_b", "device",
                      "arch", "device_name", "precision", "dynamic", "bias", "activation", "scaling"}
    return f"unknown problem fields {sorted(extra)}" if extra else None


def _choice(name, c) -> str | None:
    if not isinstance(c, dict):
        return f"choice {name!r} is not an object"
    family = BY_NAME.get(c.get("template")) if isinstance(c.get("template"), str) else None
    if family is None:
        return f"choice {name!r}: unknown template {c.get('template')!r}"
    if c.get("backend") != family.backend:
        return f"choice {name!r}: backend {c.get('backend')!r} does not build {family.name}"
    if not isinstance(c.get("dtype"), str) or c["dtype"] not in DTYPES_BY_NAME:
        return f"choice {name!r}: dtype {c.get('dtype')!r}"
    cfg = c.get("config")
    why = config_problem(cfg) if cfg is not None else None
    if why:
        return f"choice {name!r}: {why}"
    params = c.get("params", [])
    if not isinstance(params, list):
        return f"choice {name!r}: params malformed"
    for pair in params:
        why = param_problem(pair) if isinstance(pair, list) else f"parameter {pair!r} malformed"
        if why:
            return f"choice {name!r}: {why}"
    if set(c) - {"backend", "template", "dtype", "config", "params"}:
        return f"choice {name!r}: unknown fields"
    built = Choice(c["backend"], c["template"], c["dtype"], GemmConfig.from_dict(cfg) if cfg else None,
                   tuple((k, v) for k, v in params))
    return None if built.name == name else f"choice {name!r} spells {built.name!r}"


def problems(data) -> str | None:
    """Why this stored selection cannot be used, or None when it passes. Never raises."""
    try:
        return _problems(data)
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:     # a shape no check foresaw
        return f"malformed ({type(e).__name__}: {e})"


def _problems(data) -> str | None:
    if not isinstance(data, dict):
        return "not an object"
    if data.get("schema") != SCHEMA_VERSION:
        return f"schema {data.get('schema')!r}, expected {SCHEMA_VERSION}"
    why = _problem(data.get("problem"))
    if why:
        return why
    choices = data.get("choices")
    if not (isinstance(choices, dict) and choices):
        return "no choices"
    for name, c in choices.items():
        why = _choice(name, c)
        if why:
            return why
    if not isinstance(data.get("winner"), str) or data["winner"] not in choices:
        return "the winner is not among the choices"
    timings = data.get("timings")
    if not valid_timings(timings):
        return "timings malformed"
    if not isinstance(timings.get(data["winner"]), (int, float)):
        return "the winner has no time"
    for key in ("details", "fingerprint", "stage_seconds"):
        if not isinstance(data.get(key, {}), dict):
            return f"{key} is not an object"
    if not all(finite_non_negative(v) for v in data.get("stage_seconds", {}).values()):
        return "stage_seconds malformed"
    if not all(isinstance(v, dict) for v in data.get("details", {}).values()):
        return "details malformed"
    for key in ("notes", "unavailable"):
        if not (isinstance(data.get(key, []), list) and all(isinstance(s, str) for s in data.get(key, []))):
            return f"{key} malformed"
    for key in ("tune_seconds", "created"):
        if not finite_non_negative(data.get(key, 0.0)):
            return f"{key} is not a time"
    if data.get("created", 0.0) > time.time() + MAX_CREATED_AHEAD_S:
        return f"created {data['created']!r} is in the future (past this clock by more than a day)"
    if data.get("regime", "burst") not in ("steady", "burst"):
        return "regime is neither steady nor burst"
    pending = data.get("pending", [])
    if not (isinstance(pending, list) and all(isinstance(n, str) and n in choices for n in pending)
            and len(set(pending)) == len(pending)):
        return "pending is not a list of distinct recorded choices"
    duel = data.get("duel")
    if duel is not None and not (isinstance(duel, str) and duel in choices and duel != data["winner"]
                                 and isinstance(timings.get(duel), (int, float)) and data.get("regime") == "steady"):
        return "duel is not a timed challenger of a steady-regime selection"
    unmeasured = data.get("unmeasured", [])
    if not (isinstance(unmeasured, list)
            and all(isinstance(n, str) and n in choices and n not in (data["winner"], duel)
                    and isinstance(timings.get(n), str) for n in unmeasured)
            and len(set(unmeasured)) == len(unmeasured) and (not unmeasured or data.get("regime") == "steady")):
        return "unmeasured is not a list of distinct untimed candidates of a steady-regime selection"
    return None
