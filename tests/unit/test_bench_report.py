"""Report writers on synthetic results: tables (rich and plain), JSON, CSV, plot; and the summary maths."""
import csv
import io
import json
import math

import pytest

from bench import report as rp
from bench.results import Cell, DeviceFacts, KernelsMmResult, Report, ShapeResult, geomean, summarize


def _report(mode="gpu") -> Report:
    facts = DeviceFacts("cuda", "NVIDIA H100", peak_tflops=800.0, peak_shape="bf16 8192^3 torch.mm",
                        bandwidth_gbs=3000.0, copy_bytes=1 << 30)
    s1 = ShapeResult(4096, 4096, 4096, "mm", "bf16", "nn", 2 * 4096**3, 3 * 4096 * 4096 * 2,
                     facts.floor_ms(2 * 4096**3, 3 * 4096 * 4096 * 2))
    s1.cells = {"aten": Cell("aten", "ok", "aten_mm", 0.2, 0.19, 0.21, 687.2, 85.0, 1.0, 0.2, 0.1, 1),
                "triton": Cell("triton", "ok", "triton_mm_bf16_128x128x64_s3_w4_g8", 0.25, 0.24, 0.26, 550.0, 68.0,
                               0.8, 0.2, 12.0, 20, 2),
                "cutlass": Cell("cutlass", "unavailable", message="cutlass unavailable: CUTLASS_DIR not set")}
    s1.kernels_mm = KernelsMmResult("ok", "aten_mm", "tuned", 0.2, 0.19, 0.21, 0.2, 0.19, 0.21, 1.0, 0.004, 12.5)
    s2 = ShapeResult(32, 32, 16384, "mm", "bf16", "nn", 2 * 32 * 32 * 16384, 1, None)
    s2.cells = {"aten": Cell("aten", "ok", "aten_mm", 0.02, speedup=1.0, aten_ms=0.02),
                "triton": Cell("triton", "ok", "split_k_bf16_s16", 0.01, speedup=2.0, aten_ms=0.02),
                "cutlass": Cell("cutlass", "failed", message="build failed: see /tmp/x.log")}
    s2.kernels_mm = KernelsMmResult("error", message="NoCandidateError: nothing")
    rep = Report(args={"dtype": "bf16", "shapes": "synthetic"}, env={"gpu": "NVIDIA H100", "torch": "2.11",
                                                                     "triton": "3.6", "date": "2026-11-22"},
                 device=facts, columns=["aten", "triton", "cutlass"], shapes=[s1, s2], mode=mode)
    rep.summary = summarize(rep.columns, rep.shapes)
    return rep


def test_geomean_ignores_missing_values():
    assert geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert geomean([]) is None and geomean([None, float("nan")]) is None


def test_summary_per_column_best_overall_and_kernels_mm():
    s = _report().summary
    assert s.geomean_speedup["aten"] == pytest.approx(1.0)
    assert s.geomean_speedup["triton"] == pytest.approx(math.sqrt(0.8 * 2.0))
    assert s.geomean_speedup["cutlass"] is None and s.shapes_counted["cutlass"] == 0
    assert s.wins == {"aten": 1, "triton": 1, "cutlass": 0}
    assert s.best_overall_geomean == pytest.approx(math.sqrt(1.0 * 2.0))
    assert s.kernels_mm_geomean == pytest.approx(1.0) and s.kernels_mm_max_regret == pytest.approx(0.004)


def test_floor_is_the_larger_of_compute_and_memory():
    facts = DeviceFacts("cuda", "x", peak_tflops=1.0, bandwidth_gbs=1.0)
    assert facts.floor_ms(2e12, 1) == pytest.approx(2000.0)
    assert facts.floor_ms(1, 3e9) == pytest.approx(3000.0)
    assert DeviceFacts("cpu", "cpu").floor_ms(1, 1) is None


def test_plain_table_has_every_cell_and_the_summary():
    text = rp.plain_table(_report())
    assert "NVIDIA H100" in text and "peak 800" in text and "2026-11-22" in text
    assert "triton_mm_bf16_128x128x64_s3_w4_g8" in text and "0.2500 (0.2400-0.2600)" in text
    assert "unavailable: cutlass unavailable: CUTLASS_DIR not set" in text
    assert "failed: build failed: see /tmp/x.log" in text
    assert "regret 0.4%" in text and "error: NoCandidateError" in text
    assert "1.265x over 2 shapes" in text        # triton geomean sqrt(0.8 * 2)


def test_cpu_mode_title_says_not_performance():
    assert "correctness only" in rp.title(_report(mode="cpu-interpreter"))


def test_rich_table_renders():
    pytest.importorskip("rich")
    buf = io.StringIO()
    rp.print_table(_report(), file=buf)
    out = buf.getvalue()
    assert "split_k_bf16_s16" in out and "geomean speedup vs aten" in out and "best overall" in out


def test_int8_headers_say_tops():
    rep = _report()
    rep.args["dtype"] = "int8"
    assert "TOPS" in rp.headers(rep) and "TFLOP/s" not in rp.headers(rep)


def _fp8_report(mode="gpu") -> Report:
    """_report's numbers on fp8 rows: scaled_mm with row-wise scales."""
    rep = _report(mode)
    for sr in rep.shapes:
        sr.op, sr.dtype, sr.layout, sr.scaling = "scaled_mm", "fp8", "nt", "row"
    rep.args["dtype"] = "fp8"
    return rep


def test_fp8_rows_name_the_scaling_and_kernels_scaled_mm(tmp_path):
    rows = rp.rows(_fp8_report())
    assert rows[0][0] == "4096x4096x4096 fp8 nt row" and rows[0][1] == "aten"
    km = next(r for r in rows if r[1] == "kernels.scaled_mm" and "aten_mm [tuned" in r[2])
    assert km[-2] == "1.000x"                         # against the row's aten: torch._scaled_mm's own call
    text = rp.plain_table(_fp8_report())
    assert "kernels.scaled_mm vs torch._scaled_mm" in text and "kernels.mm" not in text
    assert "kernels.scaled_mm's torch._scaled_mm is the aten row" in rp.legend(_fp8_report())
    assert "kernels.scaled_mm" in rp.plain_table(_fp8_report(mode="cpu-interpreter"))
    assert "TFLOP/s" in rp.headers(_fp8_report())
    rp.write_csv(_fp8_report(), tmp_path / "r.csv")
    lines = [ln for ln in (tmp_path / "r.csv").read_text().splitlines() if not ln.startswith("#")]
    assert {r["scaling"] for r in csv.DictReader(lines)} == {"row"}


def test_json_round_trips_every_number(tmp_path):
    path = tmp_path / "r.json"
    rp.write_json(_report(), path)
    data = json.loads(path.read_text())
    assert data["device"]["peak_tflops"] == 800.0 and data["env"]["torch"] == "2.11"
    cell = data["shapes"][0]["cells"]["triton"]
    assert (cell["median_ms"], cell["p20_ms"], cell["p80_ms"], cell["tune_s"]) == (0.25, 0.24, 0.26, 12.0)
    assert data["shapes"][0]["kernels_mm"]["regret"] == 0.004
    assert data["summary"]["wins"]["triton"] == 1


def test_csv_rows_and_environment_comments(tmp_path):
    path = tmp_path / "r.csv"
    rp.write_csv(_report(), path)
    text = path.read_text()
    comments = [ln for ln in text.splitlines() if ln.startswith("#")]
    assert "# gpu: NVIDIA H100" in comments and "# device_peak_tflops: 800.0" in comments
    rows = list(csv.DictReader(ln for ln in text.splitlines() if not ln.startswith("#")))
    assert len(rows) == 2 * 3 + 2     # 3 columns + kernels.mm per shape
    tri = next(r for r in rows if r["column"] == "triton" and r["m"] == "4096")
    assert float(tri["median_ms"]) == 0.25 and tri["best"].startswith("triton_mm")
    km = next(r for r in rows if r["column"] == "kernels.mm" and r["m"] == "4096")
    assert float(km["km_speedup"]) == 1.0 and km["km_winner"] == "aten_mm"


def test_plot_file_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    rp.write_plot(_report(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    import builtins
    real_import = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    with pytest.raises(rp.PlotError, match="pip install matplotlib"):
        rp.write_plot(_report(), tmp_path / "p.png")


def test_a_column_is_never_fastest_on_more_shapes_than_its_geomean_is_over():
    """Cells with times but no speedup (no aten beside them) count for neither: once they made "- over 0 shapes"
    stand beside "fastest on 2"."""
    rep = _report()
    s3 = ShapeResult(64, 64, 64, "mm", "bf16", "nn", 2 * 64**3, 1, None)
    s3.cells = {"aten": Cell("aten", "ok", "aten_mm", 0.02), "triton": Cell("triton", "ok", "triton_mm_x", 0.01)}
    rep.shapes.append(s3)
    s = summarize(rep.columns, rep.shapes)
    for c in rep.columns:
        assert s.wins[c] <= s.shapes_counted[c]
    assert sum(s.wins.values()) == 2 and s.shapes == 3
    text = rp.plain_table(rep)
    assert "1.265x over 2 shapes         fastest on 1 of them" in text


def test_correctness_mode_table_and_summary_have_no_speed():
    rep = _report(mode="cpu-interpreter")
    rep.summary = summarize(rep.columns, rep.shapes, speed=False)
    text = rp.plain_table(rep)
    assert rp.headers(rep) == rp.CORRECTNESS_HEADERS
    assert "vs aten" not in text and "geomean" not in text and "x torch" not in text and "TFLOP/s" not in text
    assert "correctness over 2 shapes" in text
    assert "failed on 1; unavailable on 1" in text      # cutlass: failed on one shape, unavailable on the other


def test_wins_go_by_speedup_when_a_cell_kept_its_tunes_time():
    """A cell the row could not re-measure has its tune's time against its tune's aten: beside the row's times only
    its speedup compares."""
    s = ShapeResult(4096, 4096, 4096, "mm", "bf16", "nn", 2 * 4096**3, 1, None)
    s.cells = {"aten": Cell("aten", "ok", "aten_mm", 0.20, speedup=1.0, aten_ms=0.20, measured="steady"),
               "triton": Cell("triton", "ok", "triton_x", 0.19, speedup=1.053, aten_ms=0.20, measured="steady"),
               "cutlass": Cell("cutlass", "ok", "cutlass_x", 0.23, speedup=1.087, aten_ms=0.25, measured="tune")}
    assert summarize(["aten", "triton", "cutlass"], [s]).wins == {"aten": 0, "triton": 0, "cutlass": 1}
