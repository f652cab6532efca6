"""Problem lists for `python -m kernels tune`: what to tune ahead, read into GemmProblems.

Three kinds of file, told apart by their suffix:
- `.csv`: a header row, then one problem per row: `m, n, k, dtype, layout` and optionally `op` (implied by the
  dtype: int8 is int_mm, e4m3 / e5m2 scaled_mm), `bias` (0/1, true/false, yes/no), `activation` (relu, gelu, silu;
  mm only), and for scaled_mm `scaling` (tensor, the default, or row) and `out_dtype` (bf16, the default, fp16,
  fp32). `layout` is bench.compare's: two letters for A then B, `n` row-major, `t` column-major (`nt` is
  nn.Linear's: the weight used transposed; the only one scaled_mm takes). Blank lines and lines starting with `#`
  are skipped.
- `.json`: a list of objects with those keys.
- `.jsonl`: a problem trace (KERNELS_RECORD, kernels.record()): one object per line, each a GemmProblem's own dict
  (strides, alignment, precision, epilogue, dynamic dims) and, for a dynamic problem, its `dynamic_spec`. Lines
  with the short keys above are accepted too.

Pure: files in, `Listed` problems out, or a ProblemListError naming the file, the line and the column (the key, in
JSON). Problems are described for no device in particular (`retarget` puts them on the one that tunes them).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

from kernels.core.dynamic_spec import DIMS, MODES, parse_buckets, parse_dims
from kernels.core.errors import KernelsError
from kernels.core.fsutil import read_regular_text
from kernels.core.problem import (ACTIVATIONS, MAX_DIM, OPS, SCALED_MULTIPLE, SCALED_OUT_DTYPES, SCALINGS,
                                  GemmProblem, op_of, precision_of)
from kernels.space.shapes import Shape, problem_of

SUFFIXES = (".csv", ".json", ".jsonl")
LAYOUTS = ("nn", "nt", "tn", "tt")
REQUIRED = ("m", "n", "k", "dtype", "layout")
OPTIONAL = ("op", "bias", "activation", "scaling", "out_dtype")
ALIGNMENTS = (1, 2, 4, 8, 16)
PRECISIONS = ("ieee", "tf32")
# a trace line: GemmProblem's fields, and for a dynamic problem how kernels.Dynamic declared it
RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(GemmProblem))
RECORD_DEFAULTS = {"precision": None, "dynamic": (), "bias": False, "activation": "", "scaling": ""}  # older traces
# lack them
DYNAMIC_SPEC_KEYS = ("hints", "mode", "buckets", "pool")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
# a list is read whole: a long-lived trace of ~400-byte lines stays far below this
MAX_LIST_BYTES = 256 << 20


class ProblemListError(KernelsError, ValueError):
    """A problem list that cannot be read; the message names the file, the line and the column (or key)."""


class ProblemListWarning(UserWarning):
    """A problem list was read with a part left out (a trace's partial last line)."""


@dataclass(frozen=True)
class DynamicSpec:
    """How a dynamic problem was declared (kernels.Dynamic, resolved): hints per dim, runtime mode, buckets, pool."""
    hints: tuple[tuple[str, tuple[int, ...]], ...]
    mode: str
    buckets: str
    pool: int

    def as_dict(self) -> dict:
        return {"hints": {d: list(h) for d, h in self.hints}, "mode": self.mode, "buckets": self.buckets,
                "pool": self.pool}


@dataclass(frozen=True)
class Listed:
    """One listed problem and where it was first listed ('file:line')."""
    problem: GemmProblem
    dynamic: DynamicSpec | None
    where: str

    def same(self) -> tuple:
        """What makes two listed problems one to tune."""
        return (self.problem, self.dynamic)


class _Where:
    """file:line, and the column or key, for error messages."""

    def __init__(self, name: str, line: int):
        self.name, self.line = name, line

    def __str__(self) -> str:
        return f"{self.name}:{self.line}"

    def error(self, column: str, what: str) -> ProblemListError:
        return ProblemListError(f"{self}: {column}: {what}")


# -- values ----------------------------------------------------------------------------------------------------
_DIGITS = re.compile(r"[0-9]{1,12}")     # ASCII digits only ("²".isdigit() is True), short of int()'s own limits


def _positive(value, where: _Where, column: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)) or \
            (isinstance(value, str) and not _DIGITS.fullmatch(value.strip())):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise where.error(column, f"{shown} is not a positive integer below {MAX_DIM}")
    n = int(value)
    if n < 1:
        raise where.error(column, f"{n} is not a positive integer")
    if n >= MAX_DIM:
        raise where.error(column, f"{n} is not below {MAX_DIM} (2**31): no tensor of ours is that long")
    return n


def _choice(value, allowed: tuple[str, ...], where: _Where, column: str) -> str:
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in allowed:
        raise where.error(column, f"{value!r} is not one of {', '.join(allowed)}")
    return text


def _flag(value, where: _Where, column: str) -> bool:
    if isinstance(value, bool) or value is None:
        return bool(value)
    text = str(value).strip().lower() if isinstance(value, (str, int)) else None
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise where.error(column, f"{value!r} is not a flag (1/0, true/false, yes/no)")


def _activation(value, where: _Where, column: str) -> str:
    if value is None:
        return ""
    text = value.strip().lower() if isinstance(value, str) else value
    if text in ("", "none"):
        return ""
    return _choice(value, ACTIVATIONS, where, column)


# -- the short form: m, n, k, dtype, layout [, op, bias, activation, scaling, out_dtype] ----------------------------
def _short(values: dict[str, object], where: _Where, column) -> Listed:
    """values by column name; column(name) -> how an error names that column."""
    dtypes = tuple(d for ds in OPS.values() for d in ds)
    m, n, k = (_positive(values[d], where, column(d)) for d in ("m", "n", "k"))
    dtype = _choice(values["dtype"], dtypes, where, column("dtype"))
    layout = _choice(values["layout"], LAYOUTS, where, column("layout"))
    op = op_of(dtype)
    if values.get("op") not in (None, ""):
        if str(values["op"]).strip().lower() == "linear":
            raise where.error(column("op"), "'linear': kernels.linear's problems are mm rows (fp16 / bf16 / fp32, "
                              "layout nt) with the bias and activation columns")
        given = _choice(values["op"], tuple(OPS), where, column("op"))
        if given != op:
            raise where.error(column("op"), f"{given} takes {', '.join(OPS[given])}, not {dtype}")
    bias = _flag(values.get("bias"), where, column("bias"))
    activation = _activation(values.get("activation"), where, column("activation"))
    scaled = op == "scaled_mm"
    if (op == "int_mm" and (bias or activation)) or (scaled and activation):
        raise where.error(column("bias" if bias and not scaled else "activation"),
                          f"{op} has no {'activation' if scaled else 'epilogue'} (bias and activation are for fp16 / "
                          "bf16 / fp32 products; scaled_mm takes a bias)")
    scaling = _given(values, "scaling", SCALINGS, "tensor", scaled, op, where, column)
    out_dtype = _given(values, "out_dtype", SCALED_OUT_DTYPES, "bf16", scaled, op, where, column)
    if scaled and layout != "nt":
        raise where.error(column("layout"), f"{layout!r}: scaled_mm takes A row-major and B column-major (nt)")
    problem = dataclasses.replace(problem_of(Shape(m, n, k), dtype, layout, device="cuda", arch=0, device_name="",
                                             scaling=scaling, out_dtype=out_dtype), bias=bias, activation=activation)
    _scaled_sizes(problem, where, column)
    return Listed(problem, None, str(where))


def _given(values, name: str, allowed: tuple[str, ...], default: str, scaled: bool, op: str, where: _Where,
           column) -> str:
    """scaled_mm's `scaling` / `out_dtype` column: one of `allowed` (default when empty); other ops leave it empty."""
    value = values.get(name)
    if value in (None, ""):
        return default
    if not scaled:
        raise where.error(column(name), f"{value!r}: only scaled_mm (fp8) problems have a {name}, not {op}")
    return _choice(value, allowed, where, column(name))


# -- the trace form: GemmProblem's own dict ----------------------------------------------------------------------
def _pair(value, where: _Where, key: str, low: int) -> tuple[int, int]:
    if not isinstance(value, list) or len(value) != 2 or \
            any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in value):
        raise where.error(key, f"{value!r} is not a pair of integers >= {low}")
    return tuple(value)


def _int(value, where: _Where, key: str, allowed=None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or (allowed and value not in allowed):
        raise where.error(key, f"{value!r} is not {'one of ' + str(allowed) if allowed else 'an integer >= 0'}")
    return value


def _text(value, where: _Where, key: str) -> str:
    if not isinstance(value, str):
        raise where.error(key, f"{value!r} is not a string")
    return value


def _dynamic_spec(value, dims: tuple[str, ...], where: _Where) -> DynamicSpec:
    key = "key 'dynamic_spec"
    if not isinstance(value, dict):
        raise where.error(f"{key}'", f"{value!r} is not an object")
    unknown = sorted(set(value) - set(DYNAMIC_SPEC_KEYS))
    missing = [k for k in DYNAMIC_SPEC_KEYS if k not in value]
    if unknown or missing:
        raise where.error(f"{key}'", f"expected the keys {', '.join(DYNAMIC_SPEC_KEYS)}" +
                          (f"; unknown {', '.join(unknown)}" if unknown else "") +
                          (f"; missing {', '.join(missing)}" if missing else ""))
    hints = value["hints"]
    if not isinstance(hints, dict) or sorted(hints) != sorted(dims) or \
            any(not isinstance(h, list) or not h or any(isinstance(x, bool) or not isinstance(x, int) or x < 1
                                                       for x in h) for h in hints.values()):
        raise where.error(f"{key}.hints'", f"{hints!r} is not one list of positive sizes per dynamic dim "
                          f"({', '.join(dims)})")
    try:
        buckets = parse_buckets(_text(value["buckets"], where, f"{key}.buckets'"))
    except ValueError as e:
        raise where.error(f"{key}.buckets'", str(e)) from e
    return DynamicSpec(hints=tuple((d, tuple(sorted(set(hints[d])))) for d in DIMS if d in hints),
                       mode=_choice(value["mode"], MODES, where, f"{key}.mode'"), buckets=buckets,
                       pool=_positive(value["pool"], where, f"{key}.pool'"))


def _record(obj: dict, where: _Where) -> Listed:
    unknown = [k for k in obj if k not in RECORD_FIELDS and k != "dynamic_spec"]
    if unknown:
        raise where.error(f"key {unknown[0]!r}", f"not a field of a recorded problem (fields: "
                          f"{', '.join(RECORD_FIELDS)}, dynamic_spec)")
    missing = [k for k in RECORD_FIELDS if k not in obj and k not in RECORD_DEFAULTS]
    if missing:
        raise where.error(f"key {missing[0]!r}", "missing" + (f" (also {', '.join(missing[1:])})"
                                                               if missing[1:] else ""))
    values = {**RECORD_DEFAULTS, **obj}
    key = lambda name: f"key {name!r}"      # noqa: E731
    op = _choice(values["op"], tuple(OPS), where, key("op"))
    dtype = _choice(values["dtype"], OPS[op], where, key("dtype"))
    if op == "scaled_mm":
        out_dtype = _choice(values["out_dtype"], SCALED_OUT_DTYPES, where, key("out_dtype"))
        scaling = _choice(values["scaling"], SCALINGS, where, key("scaling"))
    else:
        out_dtype, scaling = "int32" if op == "int_mm" else dtype, ""
        if values["out_dtype"] != out_dtype:
            raise where.error(key("out_dtype"), f"{values['out_dtype']!r}: {op} of {dtype} gives {out_dtype}")
        if values["scaling"] != "":
            raise where.error(key("scaling"), f"{values['scaling']!r}: only scaled_mm problems have a scaling")
    precision = values["precision"]
    if precision is None:
        precision = precision_of(dtype)
    elif dtype == "fp32":
        precision = _choice(precision, PRECISIONS, where, key("precision"))
    elif precision != "":
        raise where.error(key("precision"), f"{precision!r}: only fp32 products have a precision")
    if not isinstance(values["dynamic"], list) and values["dynamic"] != ():
        raise where.error(key("dynamic"), f"{values['dynamic']!r} is not a list of dims")
    try:
        dynamic = parse_dims(tuple(values["dynamic"]))
    except (AttributeError, ValueError) as e:
        raise where.error(key("dynamic"), str(e)) from e
    bias = values["bias"]
    if not isinstance(bias, bool):
        raise where.error(key("bias"), f"{bias!r} is not true or false")
    activation = _activation(values["activation"], where, key("activation"))
    if (op == "int_mm" and (bias or activation)) or (op == "scaled_mm" and activation):
        raise where.error(key("bias" if bias and op == "int_mm" else "activation"),
                          f"{op} has no {'epilogue' if op == 'int_mm' else 'activation'}")
    if dynamic and (bias or activation or op == "scaled_mm"):
        raise where.error(key("dynamic"), "kernels.linear's and scaled_mm's problems are never dynamic")
    if "dynamic_spec" in obj and not dynamic:
        raise where.error(key("dynamic_spec"), "given for a problem without dynamic dims")
    spec = None
    if dynamic:
        spec = _dynamic_spec(obj["dynamic_spec"], dynamic, where) if "dynamic_spec" in obj else None
    device = _choice(values["device"], ("cuda", "cpu"), where, key("device"))
    problem = GemmProblem(
        op=op, m=_positive(values["m"], where, key("m")), n=_positive(values["n"], where, key("n")),
        k=_positive(values["k"], where, key("k")), dtype=dtype, out_dtype=out_dtype,
        stride_a=_pair(values["stride_a"], where, key("stride_a"), 0),
        stride_b=_pair(values["stride_b"], where, key("stride_b"), 0),
        align_a=_int(values["align_a"], where, key("align_a"), ALIGNMENTS),
        align_b=_int(values["align_b"], where, key("align_b"), ALIGNMENTS), device=device,
        arch=_int(values["arch"], where, key("arch")), device_name=_text(values["device_name"], where,
                                                                         key("device_name")),
        precision=precision, dynamic=dynamic, bias=bias, activation=activation, scaling=scaling)
    _scaled_sizes(problem, where, key)
    return Listed(problem, spec, str(where))


def _scaled_sizes(problem: GemmProblem, where: _Where, column) -> None:
    """A scaled_mm problem takes K and N multiples of SCALED_MULTIPLE, as the call does (a list must not tune what
    the call refuses)."""
    k, n = problem.k, problem.n
    if problem.op == "scaled_mm" and (k % SCALED_MULTIPLE or n % SCALED_MULTIPLE):
        raise where.error(column("k" if k % SCALED_MULTIPLE else "n"), f"scaled_mm takes K and N multiples of "
                          f"{SCALED_MULTIPLE} (torch._scaled_mm's rule; kernels.scaled_mm refuses the rest), got "
                          f"K={k}, N={n}")


def _object(obj, where: _Where) -> Listed:
    """A JSON object: a recorded problem when it has strides, else the short form (keys case-insensitive)."""
    if not isinstance(obj, dict):
        raise ProblemListError(f"{where}: expected an object, got {type(obj).__name__}: {str(obj)[:80]}")
    if "stride_a" in obj or "stride_b" in obj:
        return _record(obj, where)
    low: dict[str, object] = {}
    for name, value in obj.items():
        key = str(name).strip().lower()
        if key not in REQUIRED + OPTIONAL:
            raise where.error(f"key {name!r}", f"not a known key (keys: {', '.join(REQUIRED + OPTIONAL)}; or a "
                              "recorded problem's fields)")
        low[key] = value
    missing = [k for k in REQUIRED if k not in low]
    if missing:
        raise where.error(f"key {missing[0]!r}", "missing" + (f" (also {', '.join(missing[1:])})"
                                                               if missing[1:] else ""))
    return _short(low, where, lambda name: f"key {name!r}")


# -- files -------------------------------------------------------------------------------------------------------
def parse_csv(text: str, name: str) -> list[Listed]:
    try:
        rows = [(i, [c.strip() for c in row]) for i, row in enumerate(csv.reader(io.StringIO(text)), start=1)]
    except csv.Error as e:          # a field past the csv module's limit (128 KiB), a NUL
        raise ProblemListError(f"{name}: not a problem table: {e}") from e
    rows = [(i, cells) for i, cells in rows if any(cells) and not cells[0].startswith("#")]
    if not rows:
        return []
    header_line, header = rows[0]
    columns = [c.lower() for c in header]
    for index, column in enumerate(columns, start=1):
        if column not in REQUIRED + OPTIONAL:
            raise ProblemListError(f"{name}:{header_line}: column {index} ({header[index - 1]!r}): not a known "
                                   f"column (columns: {', '.join(REQUIRED + OPTIONAL)})")
        if columns.index(column) != index - 1:
            raise ProblemListError(f"{name}:{header_line}: column {index} ({column}): given twice")
    missing = [c for c in REQUIRED if c not in columns]
    if missing:
        raise ProblemListError(f"{name}:{header_line}: the header lacks the column(s) {', '.join(missing)} "
                               f"(required: {', '.join(REQUIRED)})")
    listed = []
    for line, cells in rows[1:]:
        where = _Where(name, line)
        if len(cells) != len(columns):
            raise ProblemListError(f"{where}: {len(cells)} fields, the header has {len(columns)}")
        listed.append(_short(dict(zip(columns, cells)), where,
                             lambda c: f"column {columns.index(c) + 1} ({c})" if c in columns else c))
    return listed


def parse_json(text: str, name: str) -> list[Listed]:
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        raise ProblemListError(f"{name}:{e.lineno}: column {e.colno}: not valid JSON: {e.msg}") from e
    except (ValueError, RecursionError) as e:       # an integer past int()'s digits, nesting past the parser's depth
        raise ProblemListError(f"{name}: not a problem list: {type(e).__name__}: {str(e)[:200]}") from e
    return [_object(obj, _Where(name, line)) for line, obj in _array_items(text, name)]


def _array_items(text: str, name: str) -> list[tuple[int, object]]:
    """(line, item) for each item of the top-level JSON list (valid JSON already)."""
    decoder = json.JSONDecoder()
    i = _skip_space(text, 0)
    if not text.startswith("[", i):
        raise ProblemListError(f"{name}:{text.count(chr(10), 0, i) + 1}: expected a list of problems ([{{...}}, ...])")
    items = []
    i = _skip_space(text, i + 1)
    while not text.startswith("]", i):
        item, end = decoder.raw_decode(text, i)
        items.append((text.count("\n", 0, i) + 1, item))
        i = _skip_space(text, end)
        i = _skip_space(text, i + 1) if text.startswith(",", i) else i
    return items


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def parse_jsonl(text: str, name: str) -> list[Listed]:
    listed = []
    lines = text.splitlines()
    for line, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (RecursionError, ValueError) as e:
            if not isinstance(e, json.JSONDecodeError):     # an integer past int()'s digits, nesting too deep
                raise ProblemListError(f"{name}:{line}: not a problem: {type(e).__name__}: {str(e)[:200]}") from e
            # a line cut short is left out, the others stand: the last, unended, of a recorder killed mid-line, or
            # one with lines after it, of a write that stopped part way (a full disk), which the next recorder starts
            # a new line after (kernels.dispatch.record). Cut short: the parser ran out of text (a cut after a nested
            # object's brace too), not met something wrong within it ("{...}," is a mistake). A line that fails
            # otherwise is an error, as anywhere else; so is a cut last line that ends (a hand edit)
            last = line == len(lines)
            cut = e.pos >= len(raw.rstrip()) or e.msg.startswith("Unterminated string")
            if cut and (not last or not text.endswith("\n")):
                where = ("the trace ends in a partial line (its recorder stopped mid-write)" if last else
                         "a line cut short (a write to the trace stopped part way)")
                warnings.warn(f"{name}:{line}: {where}; that line is left out", ProblemListWarning, stacklevel=2)
                continue
            raise ProblemListError(f"{name}:{line}: column {e.colno}: not valid JSON: {e.msg}") from e
        listed.append(_object(obj, _Where(name, line)))
    return listed


PARSERS = {".csv": parse_csv, ".json": parse_json, ".jsonl": parse_jsonl}


def read(path: str | Path) -> list[Listed]:
    """The problems one file lists, in order (duplicates kept: `distinct` drops them)."""
    path = Path(path)
    parser = PARSERS.get(path.suffix.lower())
    if parser is None:
        raise ProblemListError(f"{path}: not a problem list: expected a {', '.join(SUFFIXES)} file")
    try:    # a regular file only: a FIFO or a device named as a list is refused, never waited on
        text = read_regular_text(path, MAX_LIST_BYTES)
    except FileNotFoundError as e:
        raise ProblemListError(f"{path}: no such file") from e
    except OSError as e:
        raise ProblemListError(f"{path}: cannot be read: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ProblemListError(f"{path}: cannot be read: {e}") from e
    return parser(text, str(path))


def read_all(paths) -> list[Listed]:
    """Every file's problems, distinct, in the order first listed."""
    return distinct([item for path in paths for item in read(path)])


def distinct(listed: list[Listed]) -> list[Listed]:
    first: dict[tuple, Listed] = {}
    for item in listed:
        first.setdefault(item.same(), item)
    return list(first.values())


def retarget(listed: list[Listed], device: str, arch: int, device_name: str) -> list[Listed]:
    """The problems as this device meets them (a trace recorded on another machine, or the short form's placeholder
    device), distinct again: two devices' records of one product are one problem here."""
    return distinct([dataclasses.replace(item, problem=dataclasses.replace(
        item.problem, device=device, arch=arch, device_name=device_name)) for item in listed])


def line_of(item: Listed) -> str:
    """The item as one trace line, without its newline (what parse_jsonl reads back as the same problem): what
    KERNELS_RECORD writes (kernels.dispatch.record.trace_line), and how a problem travels to a tuning worker on
    another GPU (kernels.tune.gpu_pool)."""
    data = dataclasses.asdict(item.problem)
    if item.dynamic is not None:
        data["dynamic_spec"] = item.dynamic.as_dict()
    return json.dumps(data, sort_keys=True, separators=(",", ":"))


def from_line(line: str, where: str) -> Listed:
    """line_of's inverse; `where` is where the problem was first listed (kept for the report)."""
    (item,) = parse_jsonl(line + "\n", where)      # one whole line: a bad one is an error, never left out
    return dataclasses.replace(item, where=where)
