"""The settings a user may change, in one table (SETTINGS). Each is an attribute of `kernels.config`, read from its
environment variable when it is used unless it was set in code (`kernels.config.backends = ("aten", "triton")`;
`kernels.config.reset()` forgets what was set in code). An invalid value fails where it is used (at the latest at
the process's first cold call, or when a problem is tuned: `Config.validate`), with a SettingError (a ValueError)
that names the variable (or the attribute) and says what is allowed. `python -m kernels config` prints the table
that README.md carries; tests/test_config.py checks that the two agree.

What used to be a knob and is not in the table is a named constant beside the code that uses it (with the reason for
its value), or a keyword parameter where a tool or a test varies it; three tuning choices that the preset makes are
code-only (INTERNAL, below). This module is also the only one that reads the environment: other tools' variables
(TRITON_INTERPRET, CUTLASS_DIR, CUDA_HOME, CXX) are read through `tool_variable` and `interpret_mode`.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any

from kernels.core.dynamic_spec import parse_dims, parse_hints
from kernels.core.errors import SettingError
from kernels.core.version import __version__

ALL_BACKENDS = ("aten", "triton", "cutlass", "padded")
WARMUP_DTYPES = ("bf16", "fp16", "int8")      # the dtypes `python -m kernels warmup` builds a default CUTLASS set for
PRESETS = ("none", "fast")
FASTPATH_MODES = ("auto", "build", "off")
CUTLASS_BUILD_MODES = ("background", "inline", "off")
DUEL_MODES = ("calls", "loop")
SEARCH_SPACES = ("default", "exhaustive")
PERF_MODELS = ("auto", "analytic", "learned")
FAST_TOP_K = 5   # the "fast" preset benchmarks this many candidates per backend, ranked by the performance model


# -- parsers: a value from the environment (text) or from code -> the setting's value; ValueError says what is allowed
def _flag(value) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError("allowed: 1, true, yes, on or 0, false, no, off")


def _number(low: float, high: float = math.inf, *, low_open: bool = False, high_open: bool = False):
    if high == math.inf:
        allowed = f"allowed: a finite number {'above' if low_open else 'from'} {low:g}"
    else:
        allowed = (f"allowed: a number in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}")

    def parse(value) -> float:
        if isinstance(value, bool):
            raise ValueError(allowed)
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise ValueError(allowed) from None
        if not math.isfinite(x) or x < low or x > high or (low_open and x == low) or (high_open and x == high):
            raise ValueError(allowed)
        return x
    return parse


# Counts (MAX_JOBS, problems, candidates) stay far below this; a number past it is a typo, not a request
POSITIVE_INT_BOUND = 1 << 31


def _positive_int(value) -> int:
    allowed = f"allowed: a positive integer below {POSITIVE_INT_BOUND}"
    if isinstance(value, bool):
        raise ValueError(allowed)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and re.fullmatch(r"\s*\+?[0-9]{1,10}\s*", value):    # ASCII: "\d" takes "٣"
        n = int(value)
    else:
        raise ValueError(allowed)
    if not 1 <= n < POSITIVE_INT_BOUND:
        raise ValueError(allowed)
    return n


def _one_of(options: tuple[str, ...], aliases: Mapping[str, str] | None = None):
    def parse(value) -> str:
        text = str(value).strip().lower()
        text = (aliases or {}).get(text, text)
        if text not in options:
            raise ValueError(f"allowed: {', '.join(options)}")
        return text
    return parse


def _preset(value) -> str:
    text = _one_of(PRESETS, {"": "none", "default": "none"})(value)
    return "" if text == "none" else text


def _backends(value) -> tuple[str, ...]:
    names = value.split(",") if isinstance(value, str) else list(value)
    names = list(dict.fromkeys(str(n).strip().lower() for n in names if str(n).strip()))
    unknown = [n for n in names if n not in ALL_BACKENDS]
    if not names or unknown:
        what = f"unknown {', '.join(unknown)}; " if unknown else ""
        raise ValueError(f"{what}allowed: a comma list of one or more of {', '.join(ALL_BACKENDS)}")
    return tuple(names)


def _split_patterns(text: str) -> list[str]:
    """Split on commas that are not inside (), [] or {} so `a{1,2}` stays one regex."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _patterns(value) -> tuple[str, ...]:
    """A comma-separated string (commas inside brackets/braces kept) or a list of regular expressions; '' or () for
    none. A string of separators only (',') is an error, not 'none'."""
    allowed = "allowed: a comma list of regular expressions"
    if isinstance(value, str):
        if not value.strip():
            return ()
        patterns = _split_patterns(value)
        if not patterns:
            raise ValueError(f"no pattern in it; {allowed}")
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        patterns = [v for v in value if v]
    else:
        raise ValueError(f"got type {type(value).__name__}; {allowed} (a str, or a list of str)")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, OverflowError, RecursionError) as e:     # a{99999999999}; thousands of nested groups
            shown = repr(pattern) if len(pattern) <= 60 else repr(pattern[:57]) + "..."
            raise ValueError(f"{shown} is not a regular expression ({type(e).__name__}: {str(e)[:120]}); "
                             f"{allowed}") from e
    return tuple(patterns)


def _expanded(text: str, allowed: str) -> str:
    """`text` with ~ or ~user expanded, made absolute (children run elsewhere). An unknown ~user is an error: left
    as it is, it would name a folder called '~user' under whatever the working directory is."""
    if "\0" in text:       # no file has one: every use would fail with a bare "embedded null byte"
        raise ValueError(f"{text!r} holds a NUL character; {allowed}")
    path = os.path.expanduser(text)
    if path.startswith("~"):
        raise ValueError(f"{text!r}: {path.split(os.sep, 1)[0]} cannot be expanded (no such user, or no home "
                         f"directory known); {allowed}")
    return os.path.abspath(path)


def _path(value) -> str:
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str) or not text.strip():
        raise ValueError("allowed: a directory path")
    return _expanded(text, "allowed: a directory path")


def _file_or_empty(value, allowed: str) -> str:
    """A file's path (made absolute), or '' for none."""
    if isinstance(value, str) and not value.strip():
        return ""
    text = os.fspath(value) if isinstance(value, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise ValueError(allowed)
    return _expanded(text, allowed)


def _optional_file(value) -> str:
    return _file_or_empty(value, "allowed: a file path, or empty for none")


def _trace_path(value) -> str:
    """A file the problem trace is appended to; '' for off. A directory is refused (the trace is one file)."""
    allowed = "allowed: a file path (appended to: one JSON line per distinct problem), or empty for off"
    path = _file_or_empty(value, allowed)
    if path and (os.path.isdir(path) or os.fspath(value).endswith(("/", os.sep))):
        raise ValueError(f"{path} is a directory; {allowed}")
    return path


STORE_SCHEMES = ("redis", "rediss", "unix")


def redact_url(value):
    """A store URL as messages show it: with its password replaced by ***."""
    if not isinstance(value, str):
        return value
    return re.sub(r"(://[^/@]*?:)[^/@]*@", r"\1***@", value)


def _store_url(value) -> str:
    """A Redis URL for the shared selection store, or '' for none. Checked here for shape only (scheme, host, port,
    database number): whether a server answers is found out on use, and a store that does not degrades to local
    tuning."""
    allowed = ("allowed: redis://[user:password@]host[:port][/db], rediss://... (TLS), unix:///path/to/socket, or "
               "empty for none")
    if not isinstance(value, str):
        raise ValueError(allowed)
    text = value.strip()
    if not text:
        return ""
    try:
        parts = urlsplit(text)
        port, db = parts.port, parts.path.strip("/")
    except ValueError as e:
        raise ValueError(f"{e}; {allowed}") from None
    if parts.scheme not in STORE_SCHEMES:
        raise ValueError(f"unknown scheme {parts.scheme or '(none)'!r}; {allowed}")
    if parts.scheme == "unix":
        if not parts.path.startswith("/"):
            raise ValueError(f"a unix socket needs an absolute path; {allowed}")
    elif not parts.hostname or (db and not db.isdigit()) or (port is not None and port < 1):
        raise ValueError(allowed)
    return text


def _dynamic(value) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """Dims ('m', 'm,k': each with the default size hints) or dims with their own hints ('m=16,64,256;k=1024') ->
    ((dim, hints), ...) in m, n, k order, hints () for the default; '' / () / False -> static."""
    allowed = "allowed: dims among m, n, k ('m', 'm,k'), or dims with their size hints ('m=16,64,256;k=1024')"
    if isinstance(value, str) and not value.strip():
        return ()
    if not isinstance(value, (str, bool, tuple, list, Mapping)):
        hint = " (a kernels.Dynamic goes to mm's dynamic= argument)" if hasattr(value, "dims") else ""
        raise ValueError(f"got type {type(value).__name__}{hint}; {allowed}")
    try:
        if isinstance(value, Mapping) or (isinstance(value, str) and "=" in value) or \
                (isinstance(value, tuple) and value and all(isinstance(p, tuple) for p in value)):
            pairs = parse_hints(value)
            if pairs and not isinstance(pairs[0], tuple):
                raise ValueError("size hints without their dims")
            return tuple(pairs)
        dims = parse_dims(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{e}; {allowed}") from None
    if not dims and isinstance(value, str):
        raise ValueError(f"no dimension in it; {allowed}")
    return tuple((d, ()) for d in dims)


def _benchmark_space(value) -> str | int:
    """'all', 'default', a positive integer k (top-k by the performance model), 'sample:N' (N candidates chosen by a
    stable hash of their names, plus the default list) or 'explore:N' (the performance model's top N/2 plus N/2
    chosen by a hash salted with the problem, plus the default list). The last two collect training data."""
    allowed = "allowed: all, default, a positive integer, sample:N or explore:N"
    if isinstance(value, bool):
        raise ValueError(allowed)
    if isinstance(value, int):
        return _positive_int(value)
    text = str(value).strip().lower()
    if text in ("all", "default"):
        return text
    try:
        for prefix in ("sample:", "explore:"):
            if text.startswith(prefix):
                return f"{prefix}{_positive_int(text.split(':', 1)[1])}"
        return _positive_int(text)
    except ValueError:
        raise ValueError(allowed) from None


def _perf_model(value) -> str:
    text = str(value).strip()
    if text.lower() in PERF_MODELS:
        return text.lower()
    if text.endswith(".json"):
        return text          # a learned model's parameter file
    raise ValueError(f"allowed: {', '.join(PERF_MODELS)} or a learned model's .json file")


# -- the table ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    name: str                        # the attribute of kernels.config
    env: str | None                  # its environment variable; None: set in code only (INTERNAL)
    default: Callable[[], Any]       # the value when neither is set (may depend on another setting)
    default_text: str                # the default as the table shows it
    parse: Callable[[Any], Any]      # text or a value set in code -> the value; ValueError says what is allowed
    doc: str                         # what it does: the table's last column
    shown: Callable[[Any], Any] = lambda value: value    # how an error message shows a value (secrets hidden)


def _default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "kernels" / __version__)


SETTINGS = (
    Setting("cache_dir", "KERNELS_CACHE_DIR", _default_cache_dir, "`~/.cache/kernels/<version>`", _path,
            "where tuned selections and built kernels are stored"),
    Setting("backends", "KERNELS_BACKENDS", lambda: ALL_BACKENDS, "`aten,triton,cutlass,padded`", _backends,
            "candidate backends, comma list: `aten`, `triton`, `cutlass` (where nvcc, the CUTLASS headers and an "
            "sm80/sm90 GPU are found), `padded` (misaligned problems only); a list without aten gets it added, "
            "with a warning, for a problem none of its backends can run"),
    Setting("max_jobs", "MAX_JOBS", lambda: os.cpu_count() or 1, "CPU count", _positive_int,
            "parallel compile workers"),
    Setting("preset", "KERNELS_PRESET", lambda: "", "none", _preset,
            f"`fast`: search the exhaustive grid, compile and time only the performance model's top {FAST_TOP_K} "
            "per backend"),
    Setting("lut", "KERNELS_LUT", lambda: "", "none", _optional_file,
            "lookup table (JSON): per problem, choices always timed (`add`) or the only ones timed (`only`)"),
    Setting("only", "KERNELS_ONLY", lambda: (), "none", _patterns,
            "comma list of regexes on choice names: keep only the matches (before compiling; aten always stays; a "
            "warning when nothing else does)"),
    Setting("skip", "KERNELS_SKIP", lambda: (), "none", _patterns,
            "comma list of regexes on choice names: leave out the matches (before compiling; aten always stays)"),
    Setting("verbose", "KERNELS_VERBOSE", lambda: False, "off", _flag,
            "`1`: print each tune's table of candidates and times to stderr"),
    Setting("bench_budget_ms", "KERNELS_BENCH_MS", lambda: 40.0, "40", _number(0, low_open=True),
            "milliseconds of first-pass measurement per candidate (5 samples where calls take 0.1 ms or more), and "
            "per finalist in the final round of calls under 0.1 ms (longer calls are finalized by the duel, "
            "`KERNELS_DUEL`, whatever this is)"),
    Setting("tie_tolerance", "KERNELS_TIE_TOLERANCE", lambda: 0.01, "0.01", _number(0, 1, high_open=True),
            "for calls under 0.1 ms, a candidate must beat a simpler one (aten first) by more than this fraction to "
            "win; longer calls must beat aten by more than aten's own spread in the steady regime (at least 1.5%)"),
    Setting("dynamic", "KERNELS_DYNAMIC", lambda: (), "none (static)", _dynamic,
            "dims whose size varies, when `mm(..., dynamic=)` is not given: `m`, `m,k`; with size hints: "
            "`m=16,256,4096`"),
    Setting("fastpath", "KERNELS_FASTPATH", lambda: "auto", "`auto`", _one_of(FASTPATH_MODES),
            "the C++ warm-call table: `auto` (load it, or build it in the background), `build` (blocking), `off`"),
    Setting("cutlass_build", "KERNELS_CUTLASS_BUILD", lambda: "background", "`background`",
            _one_of(CUTLASS_BUILD_MODES),
            "CUTLASS kernels a tune needs that are not built yet: `background` (tune with what is built; a low-priority "
            "process builds the rest, and the problem is re-tuned on a later cold lookup), `inline` (compile during the "
            "tune), `off` (only what `python -m kernels warmup` built)"),
    Setting("duel", "KERNELS_DUEL", lambda: "calls", "`calls`", _one_of(DUEL_MODES),
            "calls of 0.1 ms or more end their tune with a duel of aten and the fastest challenger in ~1 s turns: "
            "`calls` (on the caller's next calls, aten serving until it is decided), `loop` (in a 2-3 s loop in the tune)"),
    Setting("max_problems", "KERNELS_MAX_PROBLEMS", lambda: 4096, "4096", _positive_int,
            "distinct problems kept ready in memory; past it the oldest are dropped (looked up again in the store "
            "when they return)"),
    Setting("record", "KERNELS_RECORD", lambda: "", "none", _trace_path,
            "append each distinct problem this process looks up (cold lookups only) to this JSON-lines file, for "
            "`python -m kernels tune FILE`"),
    Setting("store", "KERNELS_STORE", lambda: "", "none", _store_url,
            "a shared selection store, `redis://host:port/db` (needs `kernels[redis]`): lookups go local, then "
            "shared, then tune; a tune publishes its winner there; binaries are built locally", redact_url),
    Setting("store_wait", "KERNELS_STORE_WAIT", lambda: 120.0, "120", _number(0),
            "seconds to wait for another machine tuning the same problem (its lock in the shared store); `0`: tune "
            "here at once"),
    Setting("store_lock_s", "KERNELS_STORE_LOCK_S", lambda: 30.0, "30", _number(1),
            "lifetime of a tuning lock in the shared store, renewed while its tuner lives: how long a crashed "
            "tuner's lock holds the others up"),
)


# -- INTERNAL: set in code only, by the tools that collect performance-model data and compare presets. Not environment
# variables and not in the README: a user picks them through KERNELS_PRESET. They stay settings (not parameters)
# because they reach tuning through kernels.mm and the selection store's fingerprint, which a tool cannot pass down.
def _default_search_space() -> str:
    return "exhaustive" if config.preset == "fast" else "default"


def _default_benchmark_space() -> str | int:
    return FAST_TOP_K if config.preset == "fast" else "all"


INTERNAL = (
    # which candidates a backend proposes: Inductor's config lists, or its whole grid
    Setting("search_space", None, _default_search_space, "", _one_of(SEARCH_SPACES), ""),
    # which of them are built and timed: all | default | k (the model's top k) | sample:N | explore:N
    Setting("benchmark_space", None, _default_benchmark_space, "", _benchmark_space, ""),
    # what ranks them for a top-k space: auto (learned when fresh for this GPU and Triton, else analytic), analytic,
    # learned, or a learned model's .json
    Setting("perf_model", None, lambda: "auto", "", _perf_model, ""),
)

# Former settings: where each went (a variable still set in the environment gets one warning; the attribute, an
# AttributeError that says it)
RETIRED = {
    "search_space": ("KERNELS_SEARCH_SPACE", "KERNELS_PRESET=fast (code: kernels.config.search_space)"),
    "benchmark_space": ("KERNELS_BENCHMARK_SPACE", "KERNELS_PRESET=fast (code: kernels.config.benchmark_space)"),
    "perf_model": ("KERNELS_PERF_MODEL", "code: kernels.config.perf_model"),
    "retime_top": ("KERNELS_RETIME_TOP", "kernels.tune.final_round.RETIME_TOP"),
    "tune_cutoff": ("KERNELS_TUNE_CUTOFF", "kernels.measure.timing.TUNE_CUTOFF"),
    "host_bound_tolerance": ("KERNELS_HOST_BOUND_TOLERANCE", "kernels.tune.final_round.HOST_BOUND_TOLERANCE"),
    "lock_timeout_s": ("KERNELS_LOCK_TIMEOUT", "kernels.core.fsutil.LOCK_TIMEOUT_S"),
    "cutlass_max_profiling_configs": ("KERNELS_CUTLASS_MAX_CONFIGS", "backends.cutlass.CUTLASS_MAX_CONFIGS"),
    "cutlass_allow": ("KERNELS_CUTLASS_ALLOW", "KERNELS_ONLY (applies to CUTLASS before its candidate limit)"),
    "cutlass_deny": ("KERNELS_CUTLASS_DENY", "KERNELS_SKIP (applies to CUTLASS before its candidate limit)"),
    "isolate": ("KERNELS_ISOLATE", "the backend's `isolated` attribute (CUTLASS's is True)"),
    "child_timeout_s": ("KERNELS_CHILD_TIMEOUT", "backends.child_handle.CHILD_TIMEOUT_S"),
    "dynamic_dims": ("", "kernels.config.dynamic (KERNELS_DYNAMIC)"),
    "dynamic_hints": ("KERNELS_DYNAMIC_HINTS", "KERNELS_DYNAMIC=m=16,256,4096, or kernels.Dynamic(hints=...)"),
    "dynamic_mode": ("KERNELS_DYNAMIC_MODE", "kernels.Dynamic(mode=...)"),
    "dynamic_buckets": ("KERNELS_DYNAMIC_BUCKETS", "kernels.Dynamic(buckets=...)"),
    "dynamic_bench_ms": ("KERNELS_DYNAMIC_BENCH_MS", "kernels.dispatch.dynamic.DYNAMIC_BENCH_MS"),
    "dynamic_pool": ("KERNELS_DYNAMIC_POOL", "kernels.Dynamic(pool=...)"),
    "dynamic_bucket_probes": ("KERNELS_DYNAMIC_BUCKET_PROBES", "kernels.dispatch.dynamic.Family.benchmark(probes=)"),
    "fastpath_dir": ("KERNELS_FASTPATH_DIR", "<cache dir>/fastpath"),
}


class _Attribute:
    """One setting on Config: the value set in code, else the environment variable's, else the default."""

    def __init__(self, setting: Setting):
        self.setting = setting

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        s = self.setting
        if s.name in obj._overrides:
            return obj._overrides[s.name]
        _warn_retired_once()
        raw = os.environ.get(s.env) if s.env else None
        if raw is None or raw == "":
            return s.default()
        try:
            return s.parse(raw)
        except (TypeError, ValueError) as e:
            raise SettingError(f"{s.env}={s.shown(raw)!r} is not valid: {e}") from None

    def __set__(self, obj, value):
        s = self.setting
        before = obj._overrides.get(s.name, _UNSET)
        if value is None:
            obj._overrides.pop(s.name, None)
        else:
            try:
                obj._overrides[s.name] = s.parse(value)
            except (TypeError, ValueError) as e:
                raise SettingError(f"kernels.config.{s.name} = {s.shown(value)!r} is not valid: {e}") from None
        if s.name in SELECTION_SETTINGS and obj._overrides.get(s.name, _UNSET) != before:
            _selection_settings_changed()


class Config:
    """`kernels.config`: one attribute per setting (SETTINGS, INTERNAL). Setting one to None forgets the value set in
    code."""

    def __init__(self):
        object.__setattr__(self, "_overrides", {})

    def __setattr__(self, name: str, value) -> None:
        if not isinstance(type(self).__dict__.get(name), _Attribute):
            raise AttributeError(_no_such_setting(name))
        super().__setattr__(name, value)

    def __getattr__(self, name: str):           # only for names that are not settings
        raise AttributeError(_no_such_setting(name))

    @contextlib.contextmanager
    def temporarily(self, **values):
        """Set these settings in code for the block, then put back what was set in code before (or nothing)."""
        before = {name: self._overrides.get(name) for name in values}
        for name, value in values.items():
            setattr(self, name, value)
        try:
            yield self
        finally:
            for name, value in before.items():
                setattr(self, name, value)

    def reset(self) -> None:
        """Forget every value set in code; environment variables apply again."""
        changed = any(name in SELECTION_SETTINGS for name in self._overrides)
        self._overrides.clear()
        if changed:
            _selection_settings_changed()

    def validate(self) -> None:
        """Read every setting: a bad one raises SettingError here. Tuning calls this first, so that a bad value
        fails the call that would use it, before anything is built, and is never taken for one backend's failure."""
        for s in SETTINGS + INTERNAL:
            getattr(self, s.name)


for _s in SETTINGS + INTERNAL:
    setattr(Config, _s.name, _Attribute(_s))

# The settings a selection depends on (what tune() builds and times; the store's fingerprint holds them). Setting one
# in code drops what this process has selected (kernels.clear_memory_cache, registered by kernels.dispatch), so that
# the next call of a problem already seen looks up or tunes under the new value instead of serving the old winner.
# A change to the environment variable itself is seen by problems not yet seen only: the warm path reads no setting.
SELECTION_SETTINGS = frozenset({"backends", "preset", "lut", "only", "skip", "search_space", "benchmark_space",
                                "perf_model"})
_UNSET = object()
_on_selection_change: list[Callable[[], None]] = []


def on_selection_settings_change(callback: Callable[[], None]) -> None:
    """Call `callback` whenever a SELECTION_SETTINGS value set in code changes (or reset() forgets one)."""
    if callback not in _on_selection_change:
        _on_selection_change.append(callback)


def _selection_settings_changed() -> None:
    for callback in list(_on_selection_change):
        callback()

config = Config()


def _no_such_setting(name: str) -> str:
    if name in RETIRED:
        return f"kernels.config.{name} is no longer a setting: see {RETIRED[name][1]}"
    return f"kernels.config has no setting {name!r}; settings: {', '.join(s.name for s in SETTINGS)}"


_retired_checked = [False]


def _warn_retired_once() -> None:
    """A variable of a former setting that is still set has no effect: say so once per process, and where it went."""
    if _retired_checked[0]:
        return
    _retired_checked[0] = True
    for env, where in RETIRED.values():
        if env and os.environ.get(env):
            warnings.warn(f"{env} is no longer read by kernels; see {where}", stacklevel=3)


# -- the table as the README shows it --------------------------------------------------------------------------
README_BEGIN, README_END = "<!-- settings:begin -->", "<!-- settings:end -->"


def settings_markdown() -> str:
    """The settings table and the other tools' variables, in markdown: what `python -m kernels config` prints and
    README.md carries between its settings markers."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    rows += [f"| `{s.env}` | {s.default_text} | {s.doc} |" for s in SETTINGS]
    rows += ["", "Other tools' variables that kernels reads (theirs, not settings of `kernels.config`):", "",
             "| variable | what it does |", "|---|---|"]
    rows += [f"| `{name}` | {doc} |" for name, doc in TOOL_VARIABLES.items()]
    return "\n".join(rows) + "\n"


def readme_settings(readme: str) -> str | None:
    """The text between the README's settings markers (None when it has none)."""
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    if begin < 0 or end < begin:
        return None
    return readme[begin + len(README_BEGIN):end].strip("\n") + "\n"


def with_readme_settings(readme: str) -> str:
    """The README with the generated table between its settings markers."""
    if readme_settings(readme) is None:
        raise ValueError(f"no {README_BEGIN} ... {README_END} section in the README")
    begin, end = readme.find(README_BEGIN), readme.find(README_END)
    return readme[:begin + len(README_BEGIN)] + "\n" + settings_markdown() + readme[end:]


# -- other tools' variables: read here (so that every environment read is in this module), documented under the
# table, and not settings of ours: their owners define them
TOOL_VARIABLES = {
    "TRITON_INTERPRET": "Triton's: `1` runs Triton kernels through its interpreter, on CPU tensors (set by the tests "
                        "on a machine without a GPU)",
    "CUTLASS_DIR": "a CUTLASS checkout to compile against (else `third_party/cutlass`, else the `nvidia-cutlass` "
                   "wheel's headers)",
    "CUDA_HOME": "where nvcc is looked for when it is not on `PATH` (then `CUDA_PATH`, then `/usr/local/cuda`)",
    "CUDA_PATH": "as `CUDA_HOME`",
    "CXX": "the C++ compiler that builds the warm-call table (default `c++`)",
}


def tool_variable(name: str, env: Mapping[str, str] | None = None) -> str:
    """Another tool's variable from the environment (or from `env`), '' when unset."""
    if name not in TOOL_VARIABLES:
        raise KeyError(f"{name} is not one of the other tools' variables kernels reads: {', '.join(TOOL_VARIABLES)}")
    return (os.environ if env is None else env).get(name, "") or ""


def interpret_mode() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels through the interpreter on CPU tensors (Triton's own reading: anything
    but a true flag is off)."""
    try:
        return _flag(tool_variable("TRITON_INTERPRET") or "0")
    except ValueError:
        return False
