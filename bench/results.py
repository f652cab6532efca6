"""Result records of a benchmark run and the summary derived from them (pure: no torch, no device)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field


# per op: kernels' entry point and torch's own function, the names a row's kernels line and the summary print
ENTRY_NAMES = {"mm": ("kernels.mm", "torch.mm"), "int_mm": ("kernels.int_mm", "torch._int_mm"),
               "scaled_mm": ("kernels.scaled_mm", "torch._scaled_mm")}


@dataclass
class TuneTiming:
    """What a column's own tune measured (its first pass and final round, beside aten in that tune), kept as tuning
    saw it. Each column is tuned at another moment and the GPU's clocks drift between them, so these are not the
    printed numbers: those come from the row's steady measurement (ShapeResult.steady)."""
    median_ms: float | None = None
    p20_ms: float | None = None       # None when the tune kept no percentiles of the samples the median is from
    p80_ms: float | None = None
    aten_ms: float | None = None      # aten in the same tune


@dataclass
class Cell:
    """One backend (or template group, or the Inductor peer) on one shape."""
    column: str
    status: str                       # ok | failed | unavailable | skipped | error | compiled
    best: str | None = None           # the column's fastest verified candidate
    median_ms: float | None = None    # ms per call: the median of its windows in the row's steady measurement
    p20_ms: float | None = None       # ... and the 20th / 80th percentile of the same windows
    p80_ms: float | None = None
    tflops: float | None = None       # TOPS for int8
    pct_floor: float | None = None    # 100 * floor / median
    speedup: float | None = None      # aten_ms / median_ms
    aten_ms: float | None = None      # the reference: the row's aten median (measured "steady"), else its tune's aten
    tune_s: float | None = None       # wall time of tuning this backend for this shape (Inductor: compile time)
    candidates: int = 0
    failed: int = 0                   # candidates without a time: unsupported, build failed, wrong result, crashed
    unsupported: int = 0              # of those failed, the ones never built (the problem is outside the template)
    message: str = ""                 # failure text, or a note (e.g. why the cell was not re-measured)
    # where the times come from: "steady" (the row's measurement, every cell of the row together), "tune" (the
    # column's own tune, when the row could not re-measure it: aten_ms is then aten in that tune), "" (none)
    measured: str = ""
    windows_ms: list[float] = field(default_factory=list)   # ms per call in each of its steady windows, in order
    window_ratio: float | None = None  # the steady regime's own ratio: median over rounds of (its window / aten's
    #                                    windows of that round), which cancels drift between rounds (the tuner's rule)
    tune_timing: TuneTiming | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.median_ms is not None

    @property
    def verified(self) -> int:
        """Candidates that matched the reference (bench tunes with verify_all: every timed candidate was verified)."""
        return self.candidates - self.failed

    @property
    def built(self) -> int:
        return self.candidates - self.unsupported


@dataclass
class KernelsMmResult:
    """`kernels.mm` itself after tuning: the user's call, measured in the row's steady regime with the other cells
    (torch.mm is that row's aten cell: the same call, the same windows), and the regret its tune saw."""
    status: str                       # ok | error
    winner: str | None = None
    source: str = ""                  # tuned | disk | memory | cpu-fallback
    mm_ms: float | None = None        # kernels.mm per call: the median of its steady windows
    mm_p20_ms: float | None = None    # ... 20th / 80th percentile of the same windows
    mm_p80_ms: float | None = None
    torch_ms: float | None = None     # torch.mm (torch._int_mm) in the same measurement: the row's aten median
    torch_p20_ms: float | None = None
    torch_p80_ms: float | None = None
    speedup: float | None = None      # torch_ms / mm_ms
    regret: float | None = None       # its tune's Selection.regret(): winner / fastest finalist - 1, final round
    first_call_s: float | None = None # wall time of the first call (tuning or loading the selection)
    message: str = ""
    measured: str = ""                # "steady" when timed in the row's measurement, "" when not timed
    mm_windows_ms: list[float] = field(default_factory=list)
    window_ratio: float | None = None  # as Cell.window_ratio, against torch.mm


@dataclass
class RowRegime:
    """How a row was measured: every cell together after tuning, in kernels.measure.steady's regime."""
    baseline: str                     # the name measured twice a round (aten's candidate when the row has aten)
    reference: str | None             # the name every ratio of the row is against (aten's candidate), or None
    plan: dict                        # SteadyPlan: heat_ms, window_ms, rounds, settle_fraction
    self_spread: float | None         # the baseline against itself: median over rounds of |w1 - w2| / mean
    seconds: float = 0.0
    measured: dict[str, list[str]] = field(default_factory=dict)   # name measured -> the cells it fills
    failures: dict[str, str] = field(default_factory=dict)         # name -> why it has no steady time


@dataclass
class ShapeResult:
    m: int
    n: int
    k: int
    op: str
    dtype: str
    layout: str
    flops: int
    min_bytes: int
    floor_ms: float | None
    cells: dict[str, Cell] = field(default_factory=dict)
    kernels_mm: KernelsMmResult | None = None
    notes: list[str] = field(default_factory=list)
    steady: RowRegime | None = None   # the row's measurement (None: not measured together, e.g. skipped)
    scaling: str = ""                 # fp8 (scaled_mm): "tensor" or "row" scales; "" for other dtypes

    def label(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"

    def heading(self) -> str:
        """What the table's first column says of the row: shape, dtype, layout (and fp8's scaling)."""
        return " ".join(p for p in (self.label(), self.dtype, self.layout, self.scaling) if p)


@dataclass
class DeviceFacts:
    """Measured once at the start: the denominators of % of floor."""
    device: str                       # "cuda" or "cpu"
    name: str
    peak_tflops: float | None = None  # dense peak of the dtype under test, from a large torch.mm
    peak_shape: str = ""
    bandwidth_gbs: float | None = None   # device copy, read + write bytes per second
    copy_bytes: int = 0
    note: str = ""

    def floor_ms(self, flops: int, min_bytes: int) -> float | None:
        if not self.peak_tflops or not self.bandwidth_gbs:
            return None
        return max(flops / (self.peak_tflops * 1e12), min_bytes / (self.bandwidth_gbs * 1e9)) * 1e3


@dataclass
class Summary:
    """What the summary lines print, each count over the same shapes as the number beside it."""
    shapes: int                                  # shapes in the run, skipped ones included
    outcomes: dict[str, dict[str, int]]          # column -> status -> shapes (ok, failed, unavailable, skipped, ...)
    partly_failed: dict[str, int]                # column -> shapes where it is ok but some built candidates failed
    kernels_mm_ok: int                           # shapes where kernels.mm ran and matched the reference
    kernels_mm_run: int                          # shapes where kernels.mm was called
    # speed: only when times are performance (a GPU); None / empty in correctness-only mode
    geomean_speedup: dict[str, float | None]     # column -> geomean over the shapes it ran beside aten
    shapes_counted: dict[str, int]               # ... and how many those are
    wins: dict[str, int]                         # column -> shapes (of those) where it was the fastest column
    best_overall_geomean: float | None           # geomean over shapes of the best column's speedup
    kernels_mm_geomean: float | None             # geomean of torch.mm / kernels.mm
    kernels_mm_shapes: int                       # ... over this many shapes
    kernels_mm_max_regret: float | None


@dataclass
class Report:
    args: dict
    env: dict
    device: DeviceFacts
    columns: list[str]
    shapes: list[ShapeResult]
    mode: str = "gpu"                 # gpu | cpu-interpreter
    summary: Summary | None = None
    prebuild: dict = field(default_factory=dict)   # the suite-wide build before the first shape: seconds, compiled

    @property
    def speed(self) -> bool:
        """Whether times are performance (a GPU run); otherwise the run checks correctness only."""
        return self.mode == "gpu"

    def to_dict(self) -> dict:
        return asdict(self)


def rates(flops: int, floor_ms: float | None, ms: float) -> tuple[float, float | None]:
    """(TFLOP/s, % of the floor) of a call taking `ms`."""
    return flops / (ms * 1e-3) / 1e12, (100.0 * floor_ms / ms if floor_ms is not None else None)


def geomean(values) -> float | None:
    vals = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def _rate(v: float | None) -> bool:
    """A speedup the geomean takes (the counts beside it count exactly these)."""
    return v is not None and v > 0 and math.isfinite(v)


def summarize(columns: list[str], shapes: list[ShapeResult], speed: bool = True) -> Summary:
    """Counts per column and status, and with `speed` the speedups over aten. A column's wins are counted over the
    shapes where it has a speedup, so it is never "fastest on" more shapes than its geomean is "over"."""
    outcomes: dict[str, dict[str, int]] = {c: {} for c in columns}
    partly_failed = {c: 0 for c in columns}
    per_col: dict[str, list[float]] = {c: [] for c in columns}
    wins = {c: 0 for c in columns}
    best_speedups = []
    for sr in shapes:
        for c, cell in sr.cells.items():
            status = "ok" if cell.ok else cell.status
            counts = outcomes.setdefault(c, {})
            counts[status] = counts.get(status, 0) + 1
            if cell.ok and cell.verified < cell.built:
                partly_failed[c] = partly_failed.get(c, 0) + 1
        if not speed:
            continue
        rated = {c: cell for c, cell in sr.cells.items() if cell.ok and _rate(cell.speedup)}
        for c, cell in rated.items():
            per_col.setdefault(c, []).append(cell.speedup)
        if rated:
            # by speedup, not time: a cell the row could not re-measure has its tune's time, against its tune's aten
            fastest = max(rated, key=lambda c: rated[c].speedup)
            wins[fastest] = wins.get(fastest, 0) + 1
            best_speedups.append(max(cell.speedup for cell in rated.values()))
    called = [sr.kernels_mm for sr in shapes if sr.kernels_mm is not None]
    km = [r for r in called if r.status == "ok"]
    km_speedups = [r.speedup for r in km if _rate(r.speedup)] if speed else []
    regrets = [r.regret for r in km if r.regret is not None] if speed else []
    return Summary(shapes=len(shapes), outcomes=outcomes, partly_failed=partly_failed, kernels_mm_ok=len(km),
                   kernels_mm_run=len(called),
                   geomean_speedup={c: geomean(v) for c, v in per_col.items()} if speed else {},
                   shapes_counted={c: len(v) for c, v in per_col.items()} if speed else {},
                   wins=wins if speed else {},
                   best_overall_geomean=geomean(best_speedups),
                   kernels_mm_geomean=geomean(km_speedups), kernels_mm_shapes=len(km_speedups),
                   kernels_mm_max_regret=max(regrets) if regrets else None)
