"""One row of bench.compare measured together: once every column is tuned, aten, the best candidate of each column,
kernels.mm and the Inductor peer run in one power-steady regime (kernels.measure.steady, the tuner's final round),
so every time and ratio printed on a row comes from the same windows.

Each column's tune times its candidates beside aten at its own moment, and the GPU drifts between those moments: on
the H100 cuBLAS drifted 18% within one run (the card reaches its power cap within a second of load and its clocks
fall from 1980 to 1200-1470 MHz), and the table printed aten 0.183 ms above a triton 0.216 ms marked "1.00x", each
ratio right against its own tune's aten (issue 27). The tunes' numbers stay in each cell's `tune_timing`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from bench.results import Cell, KernelsMmResult, RowRegime, ShapeResult, rates
from kernels.measure.steady import (SteadyPlan, SteadyResult, SteadyTiming, WindowClock, measure_steady, plan_for,
                                    window_clock)
from kernels.measure.timing import Call, Sampler, summarize

KERNELS_MM = "kernels.mm"      # the target kernels.mm's call fills (the other targets are column names)


@dataclass
class RowCalls:
    """What a row measures: name -> call, the cells each name fills, the name every ratio is against (aten's
    candidate; None when the row has no aten), and the names whose call could not be made (name -> why)."""
    calls: dict[str, Call] = field(default_factory=dict)
    fills: dict[str, list[str]] = field(default_factory=dict)
    reference: str | None = None
    failures: dict[str, str] = field(default_factory=dict)

    def add(self, name: str, target: str, make: Callable[[], Call]) -> None:
        """`target` is filled by `name`'s call, made once by `make` (a build); a failing make is recorded."""
        self.fills.setdefault(name, []).append(target)
        if name in self.calls or name in self.failures:
            return
        try:
            self.calls[name] = make()
        except Exception as e:  # noqa: BLE001 - the cell keeps its tune's numbers and says why
            self.failures[name] = _why(e)


def _why(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def measure_row(row: RowCalls, n_sets: int, device: str) -> SteadyResult | None:
    """Every call of the row in one steady regime on `device`, aten the baseline; None when no call could run. A
    first estimate of each call (kernels.measure.timing.Sampler.plan) sizes its windows."""
    estimates: dict[str, float] = {}
    for name, call in row.calls.items():
        try:
            estimates[name] = Sampler(call, n_sets, device).plan()
        except Exception as e:  # noqa: BLE001 - a call that raises is a failure, as in the regime
            row.failures[name] = _why(e)
    clock = window_clock({n: row.calls[n] for n in estimates}, n_sets, device)
    return run_regime(row, clock, estimates, plan_for(device))


def run_regime(row: RowCalls, clock: WindowClock, estimates: dict[str, float], plan: SteadyPlan
               ) -> SteadyResult | None:
    """kernels.measure.steady's regime over the calls with an estimate; its failures join the row's. A regime that
    raises (the baseline's heat-up) leaves every call without a time, each with that reason."""
    if not estimates:
        return None
    baseline = row.reference if row.reference in estimates else next(iter(estimates))
    try:
        result = measure_steady(clock, estimates, baseline, plan)
    except Exception as e:  # noqa: BLE001
        row.failures.update({n: f"the row's measurement failed: {_why(e)}" for n in estimates})
        return None
    row.failures.update(result.failures)
    return result


def window_spread(windows_ms: list[float]) -> tuple[float, float]:
    """The 20th and 80th percentiles of a cell's windows (as kernels.measure.timing reports them): the median of the
    same windows lies between them."""
    t = summarize(windows_ms, 0)
    return t.p20_ms, t.p80_ms


def apply_row(sr: ShapeResult, row: RowCalls, result: SteadyResult | None, plan: dict, speed: bool) -> None:
    """Fill the row's cells from its measurement. A cell whose call has no steady time keeps its tune's numbers
    (measured "tune", against aten in that tune) and says why; with `speed` off (no GPU) no rate or ratio is set."""
    timings = result.timings if result else {}
    ref = timings.get(row.reference) if row.reference else None
    lost_ref = (f"aten not measured with the row: {row.failures.get(row.reference, 'no time')}"
                if row.reference and ref is None else "")
    sr.steady = RowRegime(baseline=result.baseline if result else "", reference=row.reference if ref else None,
                          plan=plan, self_spread=result.self_spread if result and ref else None,
                          seconds=result.seconds if result else 0.0, measured=dict(row.fills),
                          failures=dict(row.failures))
    if lost_ref:
        sr.notes.append(lost_ref)
    for name, targets in row.fills.items():
        timing = timings.get(name)
        failure = row.failures.get(name, "no time")
        for target in targets:
            if target == KERNELS_MM:
                _fill_mm(sr.kernels_mm, timing, ref, failure, lost_ref, speed)
            else:
                _fill_cell(sr, sr.cells[target], timing, ref, failure, lost_ref, speed)


def _fill_cell(sr: ShapeResult, cell: Cell, timing: SteadyTiming | None, ref: SteadyTiming | None, failure: str,
               lost_ref: str, speed: bool) -> None:
    # the row's time when it has one and the row's aten too; else the tune's, which carries its own aten
    if (timing is None or lost_ref) and cell.tune_timing is not None:
        cell.measured = "tune"
        note = (f"not measured with the row ({failure if timing is None else lost_ref}): its tune's times, "
                f"against aten in that tune")
        cell.message = f"{cell.message}; {note}" if cell.message else note
        return
    if timing is None:     # nothing else to show (the Inductor peer has no tune of ours)
        cell.status, cell.message = "failed", f"timing failed: {failure}"
        return
    cell.measured, cell.windows_ms = "steady", list(timing.windows_ms)
    cell.median_ms = timing.median_ms
    cell.p20_ms, cell.p80_ms = window_spread(timing.windows_ms)
    cell.aten_ms = cell.speedup = cell.window_ratio = cell.tflops = cell.pct_floor = None
    if not speed:
        return
    cell.tflops, cell.pct_floor = rates(sr.flops, sr.floor_ms, cell.median_ms)
    if ref is not None:
        cell.aten_ms = ref.median_ms
        cell.speedup = ref.median_ms / cell.median_ms
        cell.window_ratio = timing.ratio


def _fill_mm(r: KernelsMmResult | None, timing: SteadyTiming | None, ref: SteadyTiming | None, failure: str,
             lost_ref: str, speed: bool) -> None:
    if r is None or r.status != "ok":
        return
    if timing is None:
        r.status, r.message = "error", f"timing failed: {failure}"
        return
    r.measured, r.mm_windows_ms, r.mm_ms = "steady", list(timing.windows_ms), timing.median_ms
    r.mm_p20_ms, r.mm_p80_ms = window_spread(timing.windows_ms)
    if not speed:
        r.message = "matches the reference (correctness only)"
        return
    if ref is None:
        r.message = f"no torch baseline: {lost_ref}" if lost_ref else r.message
        return
    r.torch_ms = ref.median_ms
    r.torch_p20_ms, r.torch_p80_ms = window_spread(ref.windows_ms)
    r.speedup = ref.median_ms / timing.median_ms
    r.window_ratio = timing.ratio
