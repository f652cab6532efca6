"""Every knob in one place: `kernels.config.<name>` reads its environment variable lazily unless set in code."""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

from kernels.core.dynamic_spec import DEFAULT_HINTS, parse_buckets, parse_dims, parse_hints, parse_mode
from kernels.core.version import __version__

ALL_BACKENDS = ("aten", "triton", "cutlass", "padded")
SEARCH_SPACES = ("default", "exhaustive")


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def _parse_backends(text: str | tuple | list) -> tuple[str, ...]:
    names = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    unknown = [n for n in names if n not in ALL_BACKENDS]
    if unknown:
        raise ValueError(f"unknown backend(s) {unknown}; known: {', '.join(ALL_BACKENDS)}")
    return tuple(names)


def _parse_space(text: str) -> str:
    if text not in SEARCH_SPACES:
        raise ValueError(f"search space must be one of {SEARCH_SPACES}, got {text!r}")
    return text


def _positive_int(text: str | int) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"expected a positive integer, got {value}")
    return value


def _parse_regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise ValueError(f"not a regular expression: {e}") from e
    return text


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


def _parse_regex_list(value: str | tuple | list) -> tuple[str, ...]:
    """A comma-separated string (commas inside brackets/braces kept) or a list of regular expressions."""
    patterns = _split_patterns(value) if isinstance(value, str) else [str(v) for v in value if str(v)]
    for pattern in patterns:
        _parse_regex(pattern)
    return tuple(patterns)


FASTPATH_MODES = ("auto", "build", "off")


def _parse_probes(text: str) -> str:
    text = str(text).strip().lower()
    if text not in ("edges", "one"):
        raise ValueError(f"bucket probes must be 'edges' or 'one', got {text!r}")
    return text



def _parse_fastpath(text: str) -> str:
    text = str(text).strip().lower()
    if text not in FASTPATH_MODES:
        raise ValueError(f"fastpath must be one of {FASTPATH_MODES}, got {text!r}")
    return text


PRESETS = ("", "fast")
PERF_MODELS = ("auto", "analytic", "learned")


def _parse_preset(text: str) -> str:
    text = text.strip().lower()
    if text in ("none", "default"):
        text = ""
    if text not in PRESETS:
        raise ValueError(f"preset must be one of {[p for p in PRESETS if p]} (or empty), got {text!r}")
    return text


def _parse_benchmark_space(value: str | int) -> str | int:
    """'all', 'default', a positive integer k (top-k by the performance model), 'sample:N' (N candidates chosen by a
    stable hash of their names, plus the default list) or 'explore:N' (the performance model's top N/2 plus N/2
    chosen by a hash salted with the problem, plus the default list). The last two collect training data."""
    usage = "benchmark space must be all, default, a positive integer, sample:N or explore:N"
    if isinstance(value, bool):
        raise ValueError(f"{usage}, got {value!r}")
    if isinstance(value, int):
        return _positive_int(value)
    text = str(value).strip().lower()
    if text in ("all", "default"):
        return text
    for prefix in ("sample:", "explore:"):
        if text.startswith(prefix):
            return f"{prefix}{_positive_int(text.split(':', 1)[1])}"
    try:
        return _positive_int(text)
    except ValueError:
        raise ValueError(f"{usage}, got {value!r}") from None


def _parse_perf_model(text: str) -> str:
    text = str(text).strip()
    if text.lower() in PERF_MODELS:
        return text.lower()
    if text.endswith(".json"):
        return text          # a learned model's parameter file
    raise ValueError(f"performance model must be one of {PERF_MODELS} or a .json parameter file, got {text!r}")


def _default_search_space() -> str:
    return "exhaustive" if config.preset == "fast" else "default"


def _default_benchmark_space() -> str | int:
    return FAST_TOP_K if config.preset == "fast" else "all"


FAST_TOP_K = 5   # the "fast" preset benchmarks this many candidates per backend, ranked by the performance model


def _default_cache_dir() -> str:
    return str(Path.home() / ".cache" / "kernels" / __version__)


class _Setting:
    """A config attribute: an explicit override, else the environment variable, else the default."""

    def __init__(self, env: str | None, default: Callable[[], Any], parse: Callable[[Any], Any]):
        self.env, self.default, self.parse = env, default, parse

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if self.name in obj._overrides:
            return obj._overrides[self.name]
        raw = os.environ.get(self.env) if self.env else None
        if raw is None or raw == "":
            return self.default()
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"bad value for environment variable {self.env}={raw!r}: {e}") from e

    def __set__(self, obj, value):
        obj._overrides[self.name] = self.parse(value) if value is not None else self.default()


class Config:
    cache_dir = _Setting("KERNELS_CACHE_DIR", _default_cache_dir, str)
    backends = _Setting("KERNELS_BACKENDS", lambda: ("aten", "triton", "padded"), _parse_backends)
    max_jobs = _Setting("MAX_JOBS", lambda: os.cpu_count() or 1, _positive_int)
    # "fast": exhaustive search space, benchmark only the performance model's top FAST_TOP_K (explicit settings win)
    preset = _Setting("KERNELS_PRESET", lambda: "", _parse_preset)
    search_space = _Setting("KERNELS_SEARCH_SPACE", _default_search_space, _parse_space)
    # which of the searched candidates are built and benchmarked: all | default | k (model top-k) | sample:N | explore:N
    benchmark_space = _Setting("KERNELS_BENCHMARK_SPACE", _default_benchmark_space, _parse_benchmark_space)
    # ranks candidates for a top-k benchmark space: auto (learned when fresh for this GPU/triton, else analytic),
    # analytic, learned, or a path to a learned model's .json
    perf_model = _Setting("KERNELS_PERF_MODEL", lambda: "auto", _parse_perf_model)
    # lookup table (JSON, see kernels/lut.py): choices always benchmarked, or the only ones, per problem
    lut = _Setting("KERNELS_LUT", lambda: "", str)
    # regexes on choice names (re.search), applied before anything is compiled; aten is never filtered out
    only = _Setting("KERNELS_ONLY", lambda: (), _parse_regex_list)
    skip = _Setting("KERNELS_SKIP", lambda: (), _parse_regex_list)
    verbose = _Setting("KERNELS_VERBOSE", lambda: False, lambda v: _parse_bool(v) if isinstance(v, str) else bool(v))
    # how many of the fastest candidates are re-timed side by side before the winner is chosen
    retime_top = _Setting("KERNELS_RETIME_TOP", lambda: 3, _positive_int)
    # a candidate must beat a simpler one by more than this fraction to win over it
    tie_tolerance = _Setting("KERNELS_TIE_TOLERANCE", lambda: 0.01, float)
    # small problems (calls under 0.1 ms): finalists whose user-call times are within this fraction of the best are
    # ranked by GPU time (from a CUDA graph) instead: host cost that close is noise between runs. 0 turns it off.
    # 3%, not more: the pick may then cost up to this much per call, and issue 2 allows 3% regret (at 5%, aten won
    # 64x22016x4096 at 1.035x the best call time on the H100, GPU times equal)
    host_bound_tolerance = _Setting("KERNELS_HOST_BOUND_TOLERANCE", lambda: 0.03, float)
    # milliseconds of measurement per candidate (spread over samples)
    bench_budget_ms = _Setting("KERNELS_BENCH_MS", lambda: 40.0, float)
    # a candidate already this many times slower than the best so far after a few samples stops being measured
    # (it cannot win; the fastest few are re-timed side by side anyway)
    tune_cutoff = _Setting("KERNELS_TUNE_CUTOFF", lambda: 1.25, float)
    # seconds to wait for another process that is tuning the same problem
    lock_timeout_s = _Setting("KERNELS_LOCK_TIMEOUT", lambda: 600.0, float)
    # CUTLASS: how many candidates are built per problem (the best-ranked by kernels.heuristics_cutlass, not by name)
    cutlass_max_profiling_configs = _Setting("KERNELS_CUTLASS_MAX_CONFIGS", lambda: 12, _positive_int)
    # CUTLASS: regexes on choice names; a choice must match allow (if set) and must not match deny (if set)
    cutlass_allow = _Setting("KERNELS_CUTLASS_ALLOW", lambda: "", _parse_regex)
    cutlass_deny = _Setting("KERNELS_CUTLASS_DENY", lambda: "", _parse_regex)
    # backends whose candidates are verified and timed in a child process (backends/isolated_child.py) before any
    # runs in the caller: a faulting kernel poisons the CUDA context it runs in. Costs a child start per tune.
    isolate = _Setting("KERNELS_ISOLATE", lambda: ("cutlass",), _parse_backends)
    # seconds an isolated verify-and-time child may run before it is killed
    child_timeout_s = _Setting("KERNELS_CHILD_TIMEOUT", lambda: 300.0, float)
    # dynamic shapes (kernels.dynamic): dims treated as dynamic when mm's `dynamic=` is not given ("" = static),
    # size hints (one winner tuned per hint), runtime mode, and which sizes share a benchmark-mode decision
    dynamic_dims = _Setting("KERNELS_DYNAMIC", lambda: (), parse_dims)
    dynamic_hints = _Setting("KERNELS_DYNAMIC_HINTS", lambda: DEFAULT_HINTS, parse_hints)
    dynamic_mode = _Setting("KERNELS_DYNAMIC_MODE", lambda: "benchmark", parse_mode)
    dynamic_buckets = _Setting("KERNELS_DYNAMIC_BUCKETS", lambda: "pow2", parse_buckets)
    # milliseconds of measurement per hint winner when a new bucket is benchmarked (benchmark mode)
    dynamic_bench_ms = _Setting("KERNELS_DYNAMIC_BENCH_MS", lambda: 10.0, float)
    # benchmark mode: how many of each hint's fastest candidates (its winner first) a new bucket benchmarks. A
    # runtime size between two hints is often best served by a hint's runner-up, not by either winner.
    dynamic_pool = _Setting("KERNELS_DYNAMIC_POOL", lambda: 3, _positive_int)
    # benchmark mode: where a new bucket is timed: "edges" (the runtime size and the bucket's first and last size,
    # ranked by the worst ratio to the fastest) or "one" (the runtime size only)
    dynamic_bucket_probes = _Setting("KERNELS_DYNAMIC_BUCKET_PROBES", lambda: "edges", _parse_probes)
    # the C++ warm-call table (kernels/fastpath.py): auto (load if built, else build in the background on the first
    # tune), build (build in the caller, blocking), off (Python dispatch only)
    fastpath = _Setting("KERNELS_FASTPATH", lambda: "auto", _parse_fastpath)
    # where it is built (one library per torch/Python/source, so cache dirs can share one)
    fastpath_dir = _Setting("KERNELS_FASTPATH_DIR", lambda: str(Path(config.cache_dir) / "fastpath"), str)

    def __init__(self):
        self._overrides: dict[str, Any] = {}

    def reset(self) -> None:
        """Forget every value set in code; environment variables apply again."""
        self._overrides.clear()

    def as_dict(self) -> dict[str, Any]:
        names = [k for k, v in type(self).__dict__.items() if isinstance(v, _Setting)]
        return {k: getattr(self, k) for k in names}


config = Config()


def interpret_mode() -> bool:
    """TRITON_INTERPRET=1 runs Triton kernels through the interpreter on CPU tensors."""
    return _parse_bool(os.environ.get("TRITON_INTERPRET", "0"))
