"""bench.row on a fake chip: a row's cells measured together, and the table printing what was measured coherently
(every ratio the quotient of printed times, every median inside its printed spread, a cell not re-measured printed
beside its own reference). The chip heats up as it runs, as the H100 did when cuBLAS drifted 18% within one run."""
import csv
import json
import re

import pytest

from bench import report as rp
from bench.results import Cell, DeviceFacts, KernelsMmResult, Report, ShapeResult, TuneTiming, summarize
from bench.row import KERNELS_MM, RowCalls, apply_row, measure_row, run_regime
from kernels.measure.steady import SteadyPlan, plan_for

PLAN = SteadyPlan(heat_ms=20.0, window_ms=5.0, rounds=6)
# cool-chip ms per call, as each column's tune saw it, at a different moment each (aten 0.183 in the first tune,
# 0.216 by the third): the contradiction the row measurement removes
TRUE_MS = {"aten_mm": 0.200, "triton_tma_128x256x64": 0.212, "cutlass3x_256x128": 0.190, KERNELS_MM: 0.201,
           "inductor": 0.230}


class HeatingChip:
    """A WindowClock: every call slows the chip a little (up to +18%), the same for every name, so a window's time
    depends on when it runs; a name in `broken` raises from its `after`-th run on (the heat-up is the baseline's
    first)."""

    def __init__(self, broken=(), after=0, true_ms=None):
        self.calls, self.broken, self.after = 0, set(broken), after
        self.true_ms = TRUE_MS if true_ms is None else true_ms
        self.runs: dict[str, int] = {}

    def __call__(self, name, untimed, timed):
        self.runs[name] = self.runs.get(name, 0) + 1
        if name in self.broken and self.runs[name] > self.after:
            raise RuntimeError(f"{name}: illegal memory access")
        self.calls += untimed + timed
        ms = self.true_ms[name] * (1 + 0.18 * min(1.0, self.calls / 2000))
        return lambda: ms


def _shape() -> ShapeResult:
    """The cells as bench.measure.tuned_cell leaves them: each column's tune's numbers, against its tune's aten."""
    sr = ShapeResult(4096, 4096, 4096, "mm", "bf16", "nn", 2 * 4096**3, 3 * 4096 * 4096 * 2, 0.15)
    for column, best, ms, aten in (("aten", "aten_mm", 0.183, 0.183), ("triton", "triton_tma_128x256x64", 0.216, 0.216),
                                   ("cutlass", "cutlass3x_256x128", 0.196, 0.202)):
        sr.cells[column] = Cell(column, "ok", best, ms, None, None, speedup=aten / ms, aten_ms=aten, tune_s=3.0,
                                candidates=4, measured="tune", tune_timing=TuneTiming(ms, None, None, aten))
    sr.cells["inductor"] = Cell("inductor", "ok", best="torch.compile max-autotune-no-cudagraphs", tune_s=40.0)
    sr.kernels_mm = KernelsMmResult("ok", winner="cutlass3x_256x128", source="tuned", regret=0.01, first_call_s=0.1)
    return sr


def _row(sr: ShapeResult) -> RowCalls:
    row = RowCalls(reference="aten_mm")
    for column, cell in sr.cells.items():
        name = cell.best if column != "inductor" else "inductor"
        row.add(name, column, lambda: (lambda i: None))
    row.add(KERNELS_MM, KERNELS_MM, lambda: (lambda i: None))
    return row


def _measured(broken=(), speed=True, after=0) -> Report:
    sr = _shape()
    row = _row(sr)
    result = run_regime(row, HeatingChip(broken, after), {n: TRUE_MS[n] for n in row.calls}, PLAN)
    apply_row(sr, row, result, PLAN.as_dict(), speed=speed)
    facts = DeviceFacts("cuda", "NVIDIA H100", peak_tflops=800.0, peak_shape="bf16", bandwidth_gbs=3000.0)
    rep = Report(args={"dtype": "bf16"}, env={"torch": "2.13", "triton": "3.6", "date": "2026-11-25"}, device=facts,
                 columns=["aten", "triton", "cutlass", "inductor"], shapes=[sr],
                 mode="gpu" if speed else "cpu-interpreter")
    rep.summary = summarize(rep.columns, rep.shapes, speed=speed)
    return rep


TIME = re.compile(r"^(\d+\.\d+)(?: \((\d+\.\d+)-(\d+\.\d+)\))?$")
RATIO = re.compile(r"^(\d+\.\d{3})x(?: \(self [\d.]+%\)| vs aten (\d+\.\d+) in its tune)?$")


def _printed(rep: Report) -> dict[str, tuple[float, float | None, float | None, float, float | None]]:
    """backend -> (median, p20, p80, ratio, the reference printed beside the ratio or None), as the table shows."""
    out = {}
    for row in rp.rows(rep):
        backend, time_text, vs_aten = row[1], row[3], row[6]
        t, r = TIME.match(time_text), RATIO.match(vs_aten)
        assert t and r, row
        median, p20, p80 = (float(v) if v else None for v in t.groups())
        out[backend] = (median, p20, p80, float(r.group(1)), float(r.group(2)) if r.group(2) else None)
    return out


def _printed_tuned(rep: Report) -> dict[str, tuple[float, float, float]]:
    """backend -> (median, ratio, reference) of the rows printed against their own tune's aten."""
    out = {}
    for row in rp.rows(rep):
        r = RATIO.match(row[6])
        if r and r.group(2):
            out[row[1]] = (float(TIME.match(row[3]).group(1)), float(r.group(1)), float(r.group(2)))
    return out


def test_every_printed_ratio_is_the_quotient_of_printed_times_and_every_median_inside_its_spread():
    rep = _measured()
    printed = _printed(rep)
    assert set(printed) == {"aten", "triton", "cutlass", "inductor", "kernels.mm"}
    aten_median = printed["aten"][0]
    for backend, (median, p20, p80, ratio, own_ref) in printed.items():
        assert p20 <= median <= p80, backend
        assert own_ref is None, backend                    # all measured with the row: aten's row is the reference
        assert ratio == pytest.approx(round(aten_median / median, 3), abs=1e-9), backend
    assert printed["aten"][3] == 1.0
    text = rp.plain_table(rep)
    assert "Rows measured together" in text and "(self " in text


def test_the_row_orders_cells_as_the_chip_does_whatever_the_tunes_saw():
    """Tuned at different moments, triton looked as fast as its aten (1.00x) while cutlass beat a faster-looking
    aten; in the row, on one chip, each ratio is the true one."""
    rep = _measured()
    cells = rep.shapes[0].cells
    for column, cell in cells.items():
        name = cell.best if column != "inductor" else "inductor"
        assert cell.measured == "steady"
        assert cell.speedup == pytest.approx(TRUE_MS["aten_mm"] / TRUE_MS[name], rel=0.03), column
        assert cell.aten_ms == cells["aten"].median_ms
    assert cells["triton"].tune_timing == TuneTiming(0.216, None, None, 0.216)     # what tuning saw, kept
    km = rep.shapes[0].kernels_mm
    assert km.torch_ms == cells["aten"].median_ms and km.speedup == pytest.approx(0.2 / 0.201, rel=0.03)


def test_a_cell_the_row_could_not_measure_prints_its_own_tunes_reference():
    rep = _measured(broken={"cutlass3x_256x128"})
    printed = _printed(rep)
    median, _, _, ratio, own_ref = printed["cutlass"]
    assert own_ref == 0.202 and median == 0.196                   # its tune's time and that tune's aten
    assert ratio == pytest.approx(round(own_ref / median, 3), abs=1e-9)
    cell = rep.shapes[0].cells["cutlass"]
    assert cell.measured == "tune" and "illegal memory access" in cell.message
    assert rep.shapes[0].steady.failures["cutlass3x_256x128"].startswith("RuntimeError")
    for backend in ("aten", "triton", "kernels.mm"):               # the others are still the row's
        assert printed[backend][4] is None


def test_without_aten_in_the_row_every_tuned_cell_keeps_its_tune_and_says_so():
    """aten's first window raises: the others have windows, but none against aten."""
    rep = _measured(broken={"aten_mm"}, after=1)
    sr = rep.shapes[0]
    assert all(sr.cells[c].measured == "tune" for c in ("aten", "triton", "cutlass"))
    assert sr.steady.reference is None and any("aten not measured with the row" in n for n in sr.notes)
    assert sr.kernels_mm.mm_ms is not None and sr.kernels_mm.torch_ms is None
    assert sr.kernels_mm.message.startswith("no torch baseline: aten not measured")
    assert sr.cells["inductor"].measured == "steady" and sr.cells["inductor"].speedup is None
    printed = _printed_tuned(rep)
    for backend in ("aten", "triton", "cutlass"):
        median, ratio, own_ref = printed[backend]
        assert ratio == pytest.approx(round(own_ref / median, 3), abs=1e-9)


def test_a_regime_that_cannot_start_leaves_every_cell_to_its_tune():
    """The baseline's heat-up raises: nothing has a steady time, each says why."""
    rep = _measured(broken={"aten_mm"})
    sr = rep.shapes[0]
    assert all(sr.cells[c].measured == "tune" for c in ("aten", "triton", "cutlass"))
    assert "the row's measurement failed: RuntimeError" in sr.cells["triton"].message
    assert sr.cells["inductor"].status == "failed" and sr.kernels_mm.status == "error"


def test_a_failing_inductor_call_is_a_failed_cell_and_kernels_mm_an_error():
    rep = _measured(broken={"inductor", KERNELS_MM})
    sr = rep.shapes[0]
    assert sr.cells["inductor"].status == "failed" and "timing failed" in sr.cells["inductor"].message
    assert sr.kernels_mm.status == "error" and "illegal memory access" in sr.kernels_mm.message


def test_json_keeps_the_rows_measurement_and_what_tuning_saw(tmp_path):
    path = tmp_path / "r.json"
    rp.write_json(_measured(), path)
    shape = json.loads(path.read_text())["shapes"][0]
    steady = shape["steady"]
    assert steady["baseline"] == steady["reference"] == "aten_mm"
    assert steady["plan"] == PLAN.as_dict() and 0 <= steady["self_spread"] < 0.2 and steady["failures"] == {}
    assert steady["measured"]["cutlass3x_256x128"] == ["cutlass"] and steady["measured"]["kernels.mm"] == ["kernels.mm"]
    aten, triton = shape["cells"]["aten"], shape["cells"]["triton"]
    assert len(aten["windows_ms"]) == 2 * PLAN.rounds and len(triton["windows_ms"]) == PLAN.rounds
    assert triton["measured"] == "steady" and triton["aten_ms"] == aten["median_ms"]
    assert triton["speedup"] == pytest.approx(aten["median_ms"] / triton["median_ms"])
    assert triton["p20_ms"] <= triton["median_ms"] <= triton["p80_ms"]
    assert 1.0 < triton["window_ratio"] < 1.1                    # the drift-cancelling ratio, triton over aten
    assert triton["tune_timing"] == {"median_ms": 0.216, "p20_ms": None, "p80_ms": None, "aten_ms": 0.216}
    km = shape["kernels_mm"]
    assert km["measured"] == "steady" and km["torch_ms"] == aten["median_ms"] and len(km["mm_windows_ms"]) == 6


def test_csv_has_the_tunes_numbers_as_columns_of_their_own(tmp_path):
    path = tmp_path / "r.csv"
    rp.write_csv(_measured(), path)
    rows = list(csv.DictReader(ln for ln in path.read_text().splitlines() if not ln.startswith("#")))
    tri = next(r for r in rows if r["column"] == "triton")
    assert float(tri["tune_timing.median_ms"]) == 0.216 and len(tri["windows_ms"].split(";")) == PLAN.rounds
    ind = next(r for r in rows if r["column"] == "inductor")
    assert ind["tune_timing.median_ms"] == "" and ind["measured"] == "steady"


def test_without_a_gpu_the_row_sets_times_but_no_rate_or_ratio():
    rep = _measured(speed=False)
    sr = rep.shapes[0]
    for cell in sr.cells.values():
        assert cell.median_ms is not None and cell.speedup is None and cell.tflops is None and cell.aten_ms is None
    assert sr.kernels_mm.torch_ms is None and sr.kernels_mm.speedup is None
    text = rp.plain_table(rep)
    assert not re.search(r"\d\.\d+x\b", text) and "measured together" not in text and "self" not in text


def test_measure_row_runs_real_calls_and_records_the_ones_that_raise():
    """The wiring on CPU (the token plan): a call that raises is a failure with its reason, the rest have windows."""
    def boom(i):
        raise ValueError("no kernel image")

    row = RowCalls(reference="aten_mm")
    row.add("aten_mm", "aten", lambda: (lambda i: sum(range(50))))
    row.add("triton_x", "triton", lambda: (lambda i: sum(range(80))))
    row.add("triton_x", "triton_tma", lambda: pytest.fail("a name is made once"))   # two columns, one call
    row.add("broken", "cutlass", lambda: boom)
    row.add("unbuilt", "padded", lambda: (_ for _ in ()).throw(RuntimeError("rebuilding failed")))
    result = measure_row(row, n_sets=1, device="cpu")
    assert result.baseline == "aten_mm" and set(result.timings) == {"aten_mm", "triton_x"}
    rounds = plan_for("cpu").rounds                  # the reference twice a round, every other column once
    assert len(result.timings["aten_mm"].windows_ms) == 2 * rounds
    assert len(result.timings["triton_x"].windows_ms) == rounds
    assert row.fills["triton_x"] == ["triton", "triton_tma"]
    assert row.failures["broken"] == "ValueError: no kernel image"
    assert row.failures["unbuilt"] == "RuntimeError: rebuilding failed"


def test_a_tuned_cell_keeps_what_its_tune_saw_and_the_row_replaces_only_the_printed_numbers():
    from bench.columns import Column, NameFilter
    from bench.measure import TuneOutcome, problem_for, tuned_cell
    from bench.shapes import Shape
    from kernels.core.choice import Choice

    aten, tile = Choice("aten", "aten_mm", "bf16"), Choice("triton", "triton_mm", "bf16", params=(("t", 1),))
    outcome = TuneOutcome(("aten", "triton"), None, {aten.name: 0.183, tile.name: 0.216},
                          {aten.name: aten, tile.name: tile}, [], 2.5)
    problem = problem_for(Shape(64, 64, 64), "bf16", "nn", "cpu")
    facts = DeviceFacts("cuda", "NVIDIA H100", peak_tflops=800.0, bandwidth_gbs=3000.0)
    cell = tuned_cell(Column("triton", "backend", "triton"), outcome, problem, facts, NameFilter(), interpreted=False)
    assert (cell.best, cell.measured, cell.median_ms, cell.aten_ms) == (tile.name, "tune", 0.216, 0.183)
    assert cell.tune_timing == TuneTiming(0.216, None, None, 0.183)
    sr = ShapeResult(64, 64, 64, "mm", "bf16", "nn", problem.flops, problem.min_bytes, None, cells={"triton": cell})
    sr.cells["aten"] = Cell("aten", "ok", aten.name, 0.183, measured="tune", tune_timing=TuneTiming(0.183))
    row = RowCalls(reference=aten.name)
    row.add(aten.name, "aten", lambda: (lambda i: None))
    row.add(tile.name, "triton", lambda: (lambda i: None))
    chip = HeatingChip(true_ms={aten.name: 0.200, tile.name: 0.190})
    apply_row(sr, row, run_regime(row, chip, chip.true_ms, PLAN), PLAN.as_dict(), speed=True)
    assert cell.measured == "steady" and cell.speedup == pytest.approx(0.200 / 0.190, rel=0.02)
    assert cell.tune_timing == TuneTiming(0.216, None, None, 0.183)
