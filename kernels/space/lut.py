"""Lookup table: a JSON file users write, share and edit that names the choices to benchmark for given problems.

    {"schema": "kernels-lut", "version": 1, "meta": {...},
     "entries": [{"gpu": "NVIDIA H100 80GB HBM3" | "*", "op": "mm", "dtype": "bf16", "shape": [M, N, K],
                  "layout": "nn" (optional: A then B, n = row-major, t = column-major), "precision": "tf32" (fp32 only,
                  optional), "mode": "add" | "only",
                  "choices": ["triton_mm_bf16_128x128x64_s3_w4_g8",
                              {"template": "triton_mm", "config": {"block_m": 64, ...}, "params": [["split", 4]]}]}]}

`add`: the entry's choices are always built and benchmarked beside the usual candidates. `only`: they are the only
candidates of the backends they name. Parsing never raises: anything bad gives a `LutWarning` naming the file and the
entry, is skipped, and the rest is used. `loads(dumps(lut)) == lut` for every table this module produces.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from kernels.core.choice import GemmConfig
from kernels.core.config import config
from kernels.core.fsutil import MAX_JSON_BYTES, atomic_write_text, read_json, read_regular_text
from kernels.core.problem import OPS, GemmProblem
from kernels.core.selection import Selection
from kernels.space.choice_rules import config_problem, param_problem
from kernels.space.families import TEMPLATE_OPS

SCHEMA = "kernels-lut"
VERSION = 1
MODES = ("add", "only")
LAYOUTS = ("nn", "nt", "tn", "tt")
PRECISIONS = ("", "ieee", "tf32")
_ENTRY_FIELDS = {"gpu", "op", "dtype", "shape", "layout", "precision", "mode", "choices"}
_TOP_FIELDS = {"schema", "version", "meta", "entries"}


class LutWarning(UserWarning):
    """Something in a lookup table could not be used; the message names the file and the entry."""

@dataclass(frozen=True)
class ChoiceRef:
    """One choice of an entry: by `name`, or by `template` + `config` (+ `params`)."""
    name: str = ""
    template: str = ""
    config: GemmConfig | None = None
    params: tuple[tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        parts = [self.template] + ([self.config.tag()] if self.config else []) + [f"{k}{v}" for k, v in self.params]
        return "_".join(parts)

    @property
    def template_name(self) -> str:
        return self.template or _template_of(self.name)

    def to_json(self):
        if self.name:
            return self.name
        out: dict = {"template": self.template}
        if self.config is not None:
            out["config"] = self.config.as_dict()
        if self.params:
            out["params"] = [[k, v] for k, v in self.params]
        return out


@dataclass(frozen=True)
class Entry:
    gpu: str
    op: str
    dtype: str
    m: int
    n: int
    k: int
    mode: str = "add"
    choices: tuple[ChoiceRef, ...] = ()
    layout: str = ""          # "" = any layout
    precision: str = ""       # "" = any (fp32 only: "ieee" or "tf32")

    def describe(self) -> str:
        return f"{self.gpu} {self.op} {self.dtype} {self.m}x{self.n}x{self.k}{' ' + self.layout if self.layout else ''}"

    def matches(self, problem: GemmProblem) -> bool:
        if (self.op, self.dtype, self.m, self.n, self.k) != (problem.op, problem.dtype, problem.m, problem.n,
                                                              problem.k):
            return False
        if self.gpu != "*" and self.gpu.strip().lower() != problem.device_name.strip().lower():
            return False
        if self.layout and self.layout != problem_layout(problem):
            return False
        return not (self.precision and self.precision != problem.precision)

    def to_json(self) -> dict:
        out = {"gpu": self.gpu, "op": self.op, "dtype": self.dtype, "shape": [self.m, self.n, self.k]}
        if self.layout:
            out["layout"] = self.layout
        if self.precision:
            out["precision"] = self.precision
        out["mode"] = self.mode
        out["choices"] = [c.to_json() for c in self.choices]
        return out


@dataclass(frozen=True)
class Match:
    """What the table says about one problem: the union of the most specific matching entries."""
    mode: str
    choices: tuple[ChoiceRef, ...]
    entries: tuple[int, ...]


@dataclass(frozen=True)
class Lut:
    entries: tuple[Entry, ...] = ()
    meta: dict = field(default_factory=dict)
    version: int = VERSION
    source: str = field(default="<memory>", compare=False)

    def lookup(self, problem: GemmProblem) -> Match | None:
        """Entries for this problem; an exact GPU name beats "*", a given layout beats any layout. Mode is "only"
        when any of the chosen entries says so."""
        hits = [(i, e) for i, e in enumerate(self.entries) if e.matches(problem)]
        if not hits:
            return None
        best = max((e.gpu != "*", bool(e.layout), bool(e.precision)) for _, e in hits)
        chosen = [(i, e) for i, e in hits if (e.gpu != "*", bool(e.layout), bool(e.precision)) == best]
        refs = tuple(dict.fromkeys(r for _, e in chosen for r in e.choices))
        mode = "only" if any(e.mode == "only" for _, e in chosen) else "add"
        return Match(mode, refs, tuple(i for i, _ in chosen))

    def to_json(self) -> dict:
        return {"schema": SCHEMA, "version": self.version, "meta": self.meta,
                "entries": [e.to_json() for e in self.entries]}


def problem_layout(problem: GemmProblem) -> str:
    """'nn', 'nt', 'tn', 'tt' (A then B; n = row-major, t = column-major), or '' for other strides."""
    letters = {"row": "n", "col": "t"}
    a, b = letters.get(problem.layout_a), letters.get(problem.layout_b)
    return a + b if a and b else ""


def _known_templates() -> dict[str, tuple[str, ...]]:
    return TEMPLATE_OPS


def _template_of(name: str) -> str:
    """The template a choice name starts with (longest match), or ''."""
    hits = [t for t in _known_templates() if name == t or name.startswith(t + "_")]
    return max(hits, key=len) if hits else ""


# -- parsing -------------------------------------------------------------------------------------------------------
class _Problems:
    def __init__(self, source: str):
        self.source = source
        self.count = 0

    def warn(self, where: str, message: str) -> None:
        self.count += 1
        warnings.warn(f"kernels lookup table {self.source}: {where}: {message}", LutWarning, stacklevel=4)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_choice(raw, op: str, where: str, bad: _Problems) -> ChoiceRef | None:
    templates = _known_templates()
    if isinstance(raw, str):
        name = raw.strip()
        template = _template_of(name)
        if not name or not template:
            bad.warn(where, f"choice {raw!r} does not start with a known template ({', '.join(templates)}); skipped")
            return None
        if op not in templates[template]:
            bad.warn(where, f"choice {name!r}: template {template} does not implement {op}; skipped")
            return None
        return ChoiceRef(name=name)
    if not isinstance(raw, dict):
        bad.warn(where, f"choice {raw!r} is neither a name nor an object; skipped")
        return None
    unknown = set(raw) - {"template", "config", "params"}
    if unknown:
        bad.warn(where, f"choice {raw!r} has unknown field(s) {sorted(unknown)}; skipped")
        return None
    template = raw.get("template")
    if not isinstance(template, str) or template not in templates:
        bad.warn(where, f"choice {raw!r}: unknown template {template!r}; skipped")
        return None
    if op not in templates[template]:
        bad.warn(where, f"choice {raw!r}: template {template} does not implement {op}; skipped")
        return None
    cfg = None
    if raw.get("config") is not None:
        why = config_problem(raw["config"])
        if why:
            bad.warn(where, f"choice {raw!r}: {why}; skipped")
            return None
        cfg = GemmConfig(**raw["config"])
    params = raw.get("params", [])
    if isinstance(params, dict):
        params = [[k, v] for k, v in params.items()]
    if not isinstance(params, list):
        bad.warn(where, f"choice {raw!r}: params must be [[name, value], ...]; skipped")
        return None
    # true / false stand for 1 / 0 (a hand-written {"sub": true}); a pair's value otherwise as given
    params = [[p[0], int(p[1])] if isinstance(p, list) and len(p) == 2 and isinstance(p[1], bool) else p
              for p in params]
    for pair in params:
        why = param_problem(pair)       # names and values are rendered into kernel source: only the known ones
        if why:
            bad.warn(where, f"choice {raw!r}: {why}; skipped")
            return None
    if cfg is None and not params:
        return ChoiceRef(name=template)      # a template without configuration (aten_mm) is its own name
    return ChoiceRef(template=template, config=cfg, params=tuple((k, v) for k, v in params))


def _parse_entry(raw, index: int, bad: _Problems) -> Entry | None:
    where = f"entry {index}"
    if not isinstance(raw, dict):
        bad.warn(where, f"not an object ({type(raw).__name__}); skipped")
        return None
    shape = raw.get("shape")
    if isinstance(shape, list) and len(shape) == 3 and all(_is_int(v) for v in shape):
        where = f"entry {index} ({raw.get('gpu', '*')} {raw.get('op')} {raw.get('dtype')} {'x'.join(map(str, shape))})"
    unknown = set(raw) - _ENTRY_FIELDS
    if unknown:
        bad.warn(where, f"unknown field(s) {sorted(unknown)} ignored")
    gpu = raw.get("gpu", "*")
    op, dtype = raw.get("op"), raw.get("dtype")
    mode, layout, precision = raw.get("mode", "add"), raw.get("layout", ""), raw.get("precision", "")
    problems = []
    if not isinstance(gpu, str) or not gpu.strip():
        problems.append(f"gpu must be a GPU name or '*', got {gpu!r}")
    if not isinstance(op, str) or op not in OPS:       # a list or an object for op: unhashable, the entry alone bad
        problems.append(f"op must be one of {list(OPS)}, got {op!r}")
    elif dtype not in OPS[op]:
        problems.append(f"dtype for {op} must be one of {list(OPS[op])}, got {dtype!r}")
    if not (isinstance(shape, list) and len(shape) == 3 and all(_is_int(v) and v > 0 for v in shape)):
        problems.append(f"shape must be [M, N, K] of positive integers, got {shape!r}")
    if mode not in MODES:
        problems.append(f"mode must be one of {list(MODES)}, got {mode!r}")
    if layout not in LAYOUTS and layout != "":
        problems.append(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    if precision not in PRECISIONS:
        problems.append(f"precision must be one of {[p for p in PRECISIONS if p]}, got {precision!r}")
    if not isinstance(raw.get("choices"), list):
        problems.append("choices must be a list")
    if problems:
        bad.warn(where, "; ".join(problems) + "; entry skipped")
        return None
    refs = []
    for j, c in enumerate(raw["choices"]):
        ref = _parse_choice(c, op, f"{where} choice {j}", bad)
        if ref is not None and ref not in refs:
            refs.append(ref)
    if not refs:
        bad.warn(where, "no usable choices; entry skipped")
        return None
    return Entry(gpu=gpu.strip(), op=op, dtype=dtype, m=shape[0], n=shape[1], k=shape[2], mode=mode,
                 choices=tuple(refs), layout=layout, precision=precision)


def parse(data, source: str = "<memory>") -> Lut:
    """A Lut from decoded JSON. Never raises: what cannot be used is warned about (LutWarning) and skipped."""
    bad = _Problems(source)
    try:
        return _parse(data, source, bad)
    except Exception as e:  # noqa: BLE001 - a parser bug must not take tuning down either
        bad.warn("table", f"could not be read ({type(e).__name__}: {e}); ignored")
        return Lut(source=source)


def _parse(data, source: str, bad: _Problems) -> Lut:
    if not isinstance(data, dict):
        bad.warn("table", f"top level must be an object, got {type(data).__name__}; ignored")
        return Lut(source=source)
    unknown = set(data) - _TOP_FIELDS
    if unknown:
        bad.warn("table", f"unknown field(s) {sorted(unknown)} ignored")
    if data.get("schema", SCHEMA) != SCHEMA:
        bad.warn("table", f"schema is {data.get('schema')!r}, expected {SCHEMA!r}; reading it anyway")
    version = data.get("version")
    if not _is_int(version) or version < 1:
        bad.warn("table", f"version must be a positive integer, got {version!r}; reading it as version {VERSION}")
        version = VERSION
    elif version > VERSION:
        bad.warn("table", f"version {version} is newer than this kernels understands ({VERSION}); "
                          "reading the fields it knows")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        bad.warn("table", f"meta must be an object, got {type(meta).__name__}; ignored")
        meta = {}
    raw_entries = data.get("entries", [])
    if not isinstance(raw_entries, list):
        bad.warn("table", f"entries must be a list, got {type(raw_entries).__name__}; no entries used")
        raw_entries = []
    entries = [e for i, raw in enumerate(raw_entries) if (e := _parse_entry(raw, i, bad)) is not None]
    return Lut(entries=tuple(entries), meta=meta, version=version, source=source)


def loads(text: str, source: str = "<memory>") -> Lut:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        _Problems(source).warn("table", f"not valid JSON ({e}); ignored")
        return Lut(source=source)
    return parse(data, source)


def load(path: str | os.PathLike) -> Lut:
    """Read a table file; an unreadable file is a warning and an empty table. Only a regular file of at most
    MAX_JSON_BYTES is read: a FIFO or a device such as /dev/zero named by KERNELS_LUT is unreadable, never waited on
    or read endlessly."""
    source = str(path)
    try:
        text = read_regular_text(Path(path), MAX_JSON_BYTES)
    except (OSError, UnicodeDecodeError) as e:
        _Problems(source).warn("table", f"cannot be read ({type(e).__name__}: {e}); ignored")
        return Lut(source=source)
    return loads(text, source)


def dumps(lut: Lut) -> str:
    return json.dumps(lut.to_json(), indent=1) + "\n"


def save(lut: Lut, path: str | os.PathLike) -> None:
    atomic_write_text(Path(path), dumps(lut))


# -- the table kernels.config.lut points at --------------------------------------------------------------------
_active: dict[str, tuple[tuple, Lut, str]] = {}
_active_lock = threading.Lock()


def active() -> tuple[Lut | None, str]:
    """The table at `kernels.config.lut` (re-read when the file changes; warnings once per version of the file) and
    a short digest of its content for the selection fingerprint; (None, "") when no table is configured."""

    path = config.lut
    if not path:
        return None, ""
    try:
        st = os.stat(path)
        stamp = (st.st_mtime_ns, st.st_size)
    except OSError:
        stamp = None
    with _active_lock:
        cached = _active.get(path)
        if cached is not None and cached[0] == stamp:
            return cached[1], cached[2]
        lut = load(path)
        digest = hashlib.sha256(dumps(lut).encode()).hexdigest()[:16]
        _active[path] = (stamp, lut, digest)
        return lut, digest


# -- export from the selection store -------------------------------------------------------------------------------
def export_from_store(root: str | os.PathLike, top_k: int = 3, mode: str = "add") -> Lut:
    """One entry per stored problem (the newest selection when several environments tuned it): its `top_k` fastest
    measured choices, so tuning results can be shipped to other machines. Problems with a fused epilogue (a bias, an
    activation: kernels.linear's) are left out, counted in the meta's `epilogue_left_out`: an entry cannot say one,
    so theirs would have merged with the plain product of their shape and pinned their choices on it."""

    newest: dict[tuple, tuple[float, Entry]] = {}
    left_out = 0
    for path in sorted(Path(root).glob("*.json")):
        data = read_json(path)
        try:
            sel = Selection.from_dict(data["selection"], source="disk")
        except Exception:  # noqa: BLE001 - a corrupt store entry is just not exported
            continue
        names = [n for n, _ in sel.ranked()[:top_k]]
        if not names:
            continue
        p = sel.problem
        if p.epilogue:
            left_out += 1
            continue
        entry = Entry(gpu=p.device_name, op=p.op, dtype=p.dtype, m=p.m, n=p.n, k=p.k, mode=mode,
                      choices=tuple(ChoiceRef(name=n) for n in names), layout=problem_layout(p),
                      precision=p.precision)
        key = (entry.gpu, entry.op, entry.dtype, entry.m, entry.n, entry.k, entry.layout, entry.precision)
        if key not in newest or sel.created >= newest[key][0]:
            newest[key] = (sel.created, entry)
    entries = tuple(e for _, e in sorted(newest.values(), key=lambda x: (x[1].gpu, x[1].op, x[1].dtype, x[1].m,
                                                                           x[1].n, x[1].k, x[1].layout)))
    meta = {"source": "python -m kernels lut export", "top_k": top_k,
            "created": time.strftime("%Y-%m-%d", time.gmtime()), "epilogue_left_out": left_out}
    return Lut(entries=entries, meta=meta)
