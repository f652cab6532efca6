"""bench.dynamic without a GPU: argument parsing, M spacing and order, summary and markdown (its runs through the
interpreter: tests/interp/test_bench_dynamic_runs.py)."""
import argparse
import math

import pytest

from bench import dynamic as bd


def test_parse_shapes_ints_range():
    assert bd.parse_shapes("4096x12288, 11008X4096") == [(4096, 12288), (11008, 4096)]
    for bad in ("4096", "4096x", "0x5", "", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            bd.parse_shapes(bad)
    assert bd.parse_ints("4096,64,256,64") == (64, 256, 4096)
    with pytest.raises(argparse.ArgumentTypeError):
        bd.parse_ints("0,4")
    assert bd.parse_range("1,8192") == (1, 8192)
    for bad in ("8192", "5,5", "9,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            bd.parse_range(bad)


def test_defaults_on_gpu_and_cpu():
    gpu = bd.resolve_args(["--out", "x.json"], has_cuda=True)
    assert gpu.shapes == [(4096, 12288), (11008, 4096)] and gpu.hints == (2, 16, 64, 128, 256, 1024, 4096)
    assert gpu.m_range == (1, 8192) and gpu.num_m == 64 and gpu.dtype == "bf16" and gpu.time_limit_s == 330
    cpu = bd.resolve_args(["--out", "x.json"], has_cuda=False)
    assert cpu.dtype == "fp16" and cpu.hints == (16, 64) and cpu.m_range == (1, 128)
    with pytest.raises(SystemExit) as e:
        bd.resolve_args(["--out", "x", "--dtype", "bf16"], has_cuda=False)
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        bd.resolve_args(["--out", "x", "--m-range", "1,10", "--num-m", "11"], has_cuda=True)
    with pytest.raises(SystemExit):
        bd.resolve_args([], has_cuda=True)                       # --out is required
    assert bd.out_paths("r/a.json") == (bd.Path("r/a.json"), bd.Path("r/a.md"))
    assert bd.out_paths("r") == (bd.Path("r/dynamic.json"), bd.Path("r/dynamic.md"))


def test_log_uniform_sizes_and_spread_order():
    ms = bd.log_uniform_sizes(1, 8192, 64)
    assert len(ms) == 64 == len(set(ms)) and ms == sorted(ms) and ms[0] == 1 and ms[-1] == 8192
    steps = [math.log2(b / a) for a, b in zip(ms[32:], ms[33:])]          # above the integer-crowded low end
    assert max(steps) / min(steps) < 1.2
    assert bd.log_uniform_sizes(5, 7, 3) == [5, 6, 7]
    with pytest.raises(ValueError):
        bd.log_uniform_sizes(1, 4, 5)
    order = bd.spread_order(64)
    assert sorted(order) == list(range(64))
    assert sorted(order[:4]) == [0, 16, 32, 48]                           # any prefix spans the range
    assert bd.spread_order(1) == [0] and sorted(bd.spread_order(5)) == list(range(5))


def _row(m, static, bench, sim, source="benchmarked"):
    return {"m": m, "static_ms": static, "benchmark_ms": bench, "similarity_ms": sim, "static_tune_s": 1.0,
            "benchmark_first_call_s": 0.1, "benchmark_bucket_s": 0.05 if source == "benchmarked" else 0.0,
            "benchmark_source": source, "similarity_first_call_s": 0.01, "benchmark_compiles": 0,
            "similarity_compiles": 0, "benchmark_hint": "m=64", "similarity_hint": "m=64", "static_winner": "aten_mm"}


def test_summary_and_markdown():
    rows = [_row(1, 1.0, 1.0, 1.0), _row(100, 2.0, 2.1, 2.6, "memory"), _row(4000, 4.0, 4.0, 4.4),
            {"m": 7, "error": "RuntimeError: boom"}, {"m": 9, "skipped": "skipped: time limit"}]
    s = bd.summarize(rows)
    assert (s["measured"], s["errors"], s["skipped"]) == (3, 1, 1)
    assert s["benchmark"]["n"] == 3 and s["benchmark"]["geomean"] == pytest.approx(1.05 ** (1 / 3))
    assert s["benchmark"]["worst"] == pytest.approx(1.05) and s["benchmark"]["worst_m"] == 100
    assert s["benchmark"]["meets_geomean"] and s["benchmark"]["meets_worst"]           # 1.016 <= 1.03, 1.05 <= 1.10
    assert s["similarity"]["geomean"] == pytest.approx((1.3 * 1.1) ** (1 / 3))
    assert s["similarity"]["worst"] == pytest.approx(1.3) and not s["similarity"]["meets_worst"]
    assert s["benchmark"]["buckets_benchmarked"] == 2 and s["benchmark"]["runtime_benchmark_s"] == pytest.approx(0.1)
    assert s["static_tune_s"] == 3.0
    report = {"device": "H100", "dtype": "bf16", "hints": [64, 256, 4096], "seconds": 12.0, "shapes": [
        {"k": 4096, "n": 12288, "hint_tunes": {"64": {"winner": "w64", "tune_s": 1.5, "source": "tuned"}},
         "hint_table": {"runtime_m": [64, 256], "rows": {
             "hint M=64 (before)": {"64": {"ms": 0.1}, "256": {"error": "x"}},
             "multi-kernel benchmark (after)": {"64": {"ms": 0.09, "hint": "m=64"}}}},
         "sweep": {"range": [1, 8192], "rows": rows, "summary": s}},
        {"k": 11008, "n": 4096, "error": "NoCandidateError: nothing"}]}
    md = bd.markdown(report)
    assert "## K=4096, N=12288" in md and "| hint M=64 (before) | 0.1000 | error |" in md
    assert "| multi-kernel benchmark (after) | 0.0900 (m=64) | — |" in md
    assert "| benchmark | 3 | 1.016 | 1.050 (100) | ≤1.03 / ≤1.1 | yes | 2 buckets, 0.10 s |" in md
    assert "| similarity | 3 |" in md and "| no |" in md
    assert "| 7 | RuntimeError: boom |" in md and "| 9 | skipped: time limit |" in md
    assert "| 100 | 2.0000 | 2.1000 | 1.050 | 2.6000 | 1.300 |" in md
    assert "ERROR: NoCandidateError: nothing" in md
