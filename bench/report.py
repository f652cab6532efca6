"""Writers for a Report: terminal table (rich when importable, plain text otherwise), JSON, CSV, bar plot."""
from __future__ import annotations

import csv
import json
import math
import sys
from dataclasses import asdict, fields
from pathlib import Path

from bench.results import ENTRY_NAMES, Cell, KernelsMmResult, Report, ShapeResult, TuneTiming

HEADERS = ("shape", "backend", "best candidate", "ms/call (p20-p80)", "TFLOP/s", "% floor", "vs aten", "tune s")
# correctness-only runs (no GPU) print no times, rates or ratios: CPU and interpreter times say nothing of a GPU
CORRECTNESS_HEADERS = ("shape", "backend", "result", "verified / built", "tune s")
PLOT_INSTALL = 'pip install "kernels[plot]" (or: pip install matplotlib)'


class PlotError(RuntimeError):
    """The plot could not be produced (matplotlib missing, nothing to plot)."""


def pyplot():
    """matplotlib.pyplot on the Agg backend; PlotError with the install line when matplotlib is missing. Called
    before a run that will plot, so that a missing matplotlib fails before any work."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotError(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}") from e
    return plt


def _fmt(v, spec: str, none: str = "-") -> str:
    return none if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def _digits(ms: float) -> int:
    """Decimals that print `ms` with 4 significant digits (0.1830, 0.02049, 1.234): enough that a ratio of two
    printed times is the printed ratio."""
    return max(0, 3 - math.floor(math.log10(ms))) if ms > 0 and math.isfinite(ms) else 4


def fmt_ms(ms: float, digits: int | None = None) -> str:
    return format(ms, f".{_digits(ms) if digits is None else digits}f")


def _ms(median, p20, p80) -> str:
    """The median and its spread, all three with the median's decimals."""
    if median is None:
        return "-"
    digits = _digits(median)
    if p20 is None or p80 is None:
        return fmt_ms(median, digits)
    return f"{fmt_ms(median, digits)} ({fmt_ms(p20, digits)}-{fmt_ms(p80, digits)})"


def ratio(ref_ms: float, ms: float) -> str:
    """ref / ms computed from the two times as printed, so a reader recomputes exactly what is shown."""
    return f"{float(fmt_ms(ref_ms)) / float(fmt_ms(ms)):.3f}x"


def _verified(cell: Cell) -> str:
    """'21 / 21, 4 unsupported': candidates that matched the reference of those built, and those never built."""
    if not cell.candidates:
        return "-"
    return f"{cell.verified} / {cell.built}" + (f", {cell.unsupported} unsupported" if cell.unsupported else "")


def _correctness_cell_row(cell: Cell) -> tuple[str, ...]:
    if not cell.ok:
        result = f"{cell.status}: {cell.message}"
    elif cell.verified < cell.built:
        result = f"partly failed: {cell.message}"
    else:
        result = "verified"
    return (cell.column, result[:120], _verified(cell), _fmt(cell.tune_s, ".1f"))


def _correctness_mm_row(r: KernelsMmResult, entry: str) -> tuple[str, ...]:
    if r.status != "ok":
        return (entry, f"error: {r.message}"[:120], "-", _fmt(r.first_call_s, ".1f"))
    return (entry, f"{r.winner} [{r.source}]: {r.message}", "-", _fmt(r.first_call_s, ".1f"))


def _vs_aten(cell: Cell, sr: ShapeResult) -> str:
    """The cell's ratio to its reference: the row's aten (printed on the row) when measured with the row; else the
    aten of its own tune, printed beside it."""
    if not cell.aten_ms or cell.median_ms is None:
        return "-"
    if cell.measured == "tune":
        return f"{ratio(cell.aten_ms, cell.median_ms)} vs aten {fmt_ms(cell.aten_ms)} in its tune"
    if sr.steady is not None and cell.best == sr.steady.reference and sr.steady.self_spread is not None:
        return f"{ratio(cell.aten_ms, cell.median_ms)} (self {sr.steady.self_spread:.1%})"
    return ratio(cell.aten_ms, cell.median_ms)


def _cell_row(cell: Cell, sr: ShapeResult) -> tuple[str, ...]:
    if not cell.ok:
        return (cell.column, f"{cell.status}: {cell.message}"[:120], "-", "-", "-", "-", _fmt(cell.tune_s, ".1f"))
    return (cell.column, cell.best or "-", _ms(cell.median_ms, cell.p20_ms, cell.p80_ms), _fmt(cell.tflops, ".1f"),
            _fmt(cell.pct_floor, ".0f"), _vs_aten(cell, sr), _fmt(cell.tune_s, ".1f"))


def _mm_row(r: KernelsMmResult, sr: ShapeResult) -> tuple[str, ...]:
    entry = ENTRY_NAMES[sr.op][0]
    if r.status != "ok":
        return (entry, f"error: {r.message}"[:120], "-", "-", "-", "-", _fmt(r.first_call_s, ".1f"))
    regret = f"regret {r.regret * 100:.1f}% in its tune" if r.regret is not None else "regret -"
    if r.torch_ms is None or r.mm_ms is None:      # e.g. torch cannot run this problem (torch._int_mm, M <= 16)
        return (entry, f"{r.winner} [{r.source}, {regret}]", f"{_ms(r.mm_ms, r.mm_p20_ms, r.mm_p80_ms)} "
                f"({r.message})"[:160], "-", "-", "-", _fmt(r.first_call_s, ".1f"))
    # torch's function is the row's aten cell: the same call in the same windows
    return (entry, f"{r.winner} [{r.source}, {regret}]", _ms(r.mm_ms, r.mm_p20_ms, r.mm_p80_ms), "-", "-",
            ratio(r.torch_ms, r.mm_ms), _fmt(r.first_call_s, ".1f"))


def rows(report: Report) -> list[tuple[str, ...]]:
    """Table rows: each shape's columns, then its kernels.mm (int_mm, scaled_mm) line (shape label only on the first
    row)."""
    out = []
    for sr in report.shapes:
        label = sr.heading()
        cells = [sr.cells[c] for c in report.columns if c in sr.cells]
        if report.speed:
            body = [_cell_row(c, sr) for c in cells] + ([_mm_row(sr.kernels_mm, sr)] if sr.kernels_mm else [])
        else:
            body = [_correctness_cell_row(c) for c in cells] + ([_correctness_mm_row(sr.kernels_mm,
                                                                                     ENTRY_NAMES[sr.op][0])]
                                                               if sr.kernels_mm else [])
        for i, r in enumerate(body):
            out.append(((label if i == 0 else ""),) + r)
    return out


def entry_names(report: Report) -> tuple[str, str]:
    """(kernels' entry point, torch's function) of the run's op: one dtype, so one op, per run."""
    return ENTRY_NAMES[report.shapes[0].op if report.shapes else "mm"]


def _shapes(n: int) -> str:
    return f"{n} shape" + ("" if n == 1 else "s")


def summary_title(report: Report) -> str:
    s = report.summary
    if report.speed:
        return "geomean speedup vs aten (over the shapes where the column ran beside aten)"
    return f"correctness over {_shapes(s.shapes)} (no speedups without a GPU)"


def summary_rows(report: Report) -> list[tuple[str, str, str]]:
    s = report.summary
    if s is None:
        return []
    if not report.speed:
        return _correctness_summary_rows(report)
    x = lambda v: "-" if v is None else f"{v:.3f}x"  # noqa: E731
    out = [(c, f"{x(s.geomean_speedup.get(c))} over {_shapes(s.shapes_counted.get(c, 0))}",
            f"fastest on {s.wins.get(c, 0)} of them") for c in report.columns]
    out.append(("best overall", x(s.best_overall_geomean), ""))
    if s.kernels_mm_geomean is not None:
        out.append((" vs ".join(entry_names(report)), f"{x(s.kernels_mm_geomean)} over {_shapes(s.kernels_mm_shapes)}",
                    "max regret " + _fmt(None if s.kernels_mm_max_regret is None else
                                         100 * s.kernels_mm_max_regret, ".1f") + "%"))
    return out


# how a correctness summary names each status, in the order it lists them
_OUTCOME_WORDS = (("ok", "verified"), ("compiled", "compiled only"), ("failed", "failed"), ("error", "error"),
                  ("unavailable", "unavailable"), ("skipped", "skipped"))


def _correctness_summary_rows(report: Report) -> list[tuple[str, str, str]]:
    s = report.summary
    out = []
    for c in report.columns:
        counts = s.outcomes.get(c, {})
        words = [f"{word} on {counts[status]}" for status, word in _OUTCOME_WORDS if counts.get(status)]
        if s.partly_failed.get(c):
            words.append(f"some candidates failed on {s.partly_failed[c]}")
        words += [f"{status} on {n}" for status, n in counts.items() if status not in dict(_OUTCOME_WORDS)]
        out.append((c, "; ".join(words) or "no cells", f"of {_shapes(s.shapes)}"))
    if s.kernels_mm_run:
        out.append((entry_names(report)[0], f"matches the reference on {s.kernels_mm_ok}",
                    f"of {s.kernels_mm_run} called"))
    return out


def title(report: Report) -> str:
    d = report.device
    if not report.speed:
        return (f"NO GPU: correctness only (Triton interpreter on {d.name}): candidates checked against a float64 "
                f"reference, no speedups")
    unit = "TOPS" if report.args.get("dtype") == "int8" else "TFLOP/s"
    return (f"{d.name} | peak {_fmt(d.peak_tflops, '.0f')} {unit} ({d.peak_shape}) | copy "
            f"{_fmt(d.bandwidth_gbs, '.0f')} GB/s | torch {report.env.get('torch')} triton "
            f"{report.env.get('triton')} | {report.env.get('date')}"
            + (f" | CUTLASS prebuilt: {report.prebuild['compiled'].get('cutlass', 0)} kernels in "
               f"{report.prebuild['seconds']:.0f} s" if report.prebuild.get("compiled") else ""))


def legend(report: Report) -> str | None:
    """How the speed table's numbers were measured and how its ratios are computed (None without a GPU)."""
    if not report.speed:
        return None
    plan = next((sr.steady.plan for sr in report.shapes if sr.steady is not None), None)
    heat = f"{plan['heat_ms']:.0f} ms heat-up, then " if plan and plan.get("heat_ms") else ""
    settle = plan.get("settle_fraction", 0.25) if plan else 0.0
    how = ("" if plan is None else
           f" ({heat}{plan['rounds']} rounds of one {plan['window_ms']:.0f} ms window per cell, the first "
           f"{settle:.0%} of each untimed, alternated; aten twice a round)")
    entry, torch_fn = entry_names(report)
    return (f"Rows measured together after tuning, in the tuner's steady regime{how}. ms/call: the median of the "
            f"cell's windows (p20-p80 of the same windows). vs aten: aten's ms/call over the cell's, as printed; "
            f"{entry}'s {torch_fn} is the aten row. self: aten's two windows of a round apart (median over rounds). "
            f"'in its tune': not re-measured with the row, against aten in that tune.")


def headers(report: Report) -> tuple[str, ...]:
    if not report.speed:
        return CORRECTNESS_HEADERS
    if report.args.get("dtype") == "int8":
        return tuple("TOPS" if h == "TFLOP/s" else h for h in HEADERS)
    return HEADERS


def plain_table(report: Report) -> str:
    hdr = headers(report)
    body = rows(report)
    widths = [max(len(hdr[i]), *(len(r[i]) for r in body)) if body else len(hdr[i]) for i in range(len(hdr))]
    line = lambda r: "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [title(report)] + ([legend(report)] if legend(report) else []) + [line(hdr),
                                                                          line(tuple("-" * w for w in widths))]
    out.extend(line(r) for r in body)
    summ = summary_rows(report)
    if summ:
        out.append("")
        out.append(summary_title(report) + ":")
        out.extend(f"  {a:<24} {b:<28} {c}".rstrip() for a, b, c in summ)
    return "\n".join(out)


def print_table(report: Report, file=None) -> None:
    """Rich table when rich is importable, else the plain-text one."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(plain_table(report), file=file)
        return
    out = file if file is not None else sys.stdout
    # piped output gets a wide fixed width so candidate names are not folded into slivers
    console = Console(file=out, width=None if out.isatty() else 220)
    console.print(Text(title(report)))        # a line of its own: a table title is wrapped to the table's width
    if legend(report):
        console.print(Text(legend(report)))
    table = Table(show_lines=False)
    for h in headers(report):
        table.add_column(h, overflow="fold")
    for r in rows(report):
        if r[0]:
            table.add_section()
        table.add_row(*(Text(v) for v in r))     # Text: "[tuned, regret 0.4%]" is not rich markup
    console.print(table)
    summ = summary_rows(report)
    if summ:
        console.print(Text(summary_title(report)))
        st = Table()
        for h in (("column", "geomean", "wins") if report.speed else ("column", "outcome", "out of")):
            st.add_column(h)
        for r in summ:
            st.add_row(*(Text(v) for v in r))
        console.print(st)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_dict(), indent=1, default=str))


# fields holding a record (or None): their fields are CSV columns of their own
_NESTED = {"tune_timing": TuneTiming}


def _flat(record: dict) -> dict:
    """A record for one CSV row: nested records as `key.field` columns, lists joined with ';'."""
    out = {}
    for key, value in record.items():
        if key in _NESTED and value is None:
            continue
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        elif isinstance(value, list):
            out[key] = ";".join(str(v) for v in value)
        else:
            out[key] = value
    return out


def _csv_names(cls) -> list[str]:
    names = []
    for f in fields(cls):
        if f.name in _NESTED:
            names += [f"{f.name}.{t.name}" for t in fields(_NESTED[f.name])]
        else:
            names.append(f.name)
    return names


CSV_FIELDS = ["m", "n", "k", "op", "dtype", "layout", "scaling", "floor_ms"] + _csv_names(Cell)
_MM_FIELDS = _csv_names(KernelsMmResult)


def write_csv(report: Report, path: str | Path) -> None:
    """One row per (shape, column), plus one row per shape for kernels.mm (column 'kernels.mm', its own fields
    prefixed km_); the environment and device facts go in leading '#' comment lines. A cell's tune numbers are the
    `tune_timing.*` columns; its steady windows are joined with ';'."""
    with Path(path).open("w", newline="") as f:
        for key, value in {**report.env, **{f"device_{k}": v for k, v in asdict(report.device).items()}}.items():
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS + [f"km_{n}" for n in _MM_FIELDS])
        writer.writeheader()
        for sr in report.shapes:
            base = {"m": sr.m, "n": sr.n, "k": sr.k, "op": sr.op, "dtype": sr.dtype, "layout": sr.layout,
                    "scaling": sr.scaling, "floor_ms": sr.floor_ms}
            for c in report.columns:
                if c in sr.cells:
                    writer.writerow({**base, **_flat(asdict(sr.cells[c]))})
            if sr.kernels_mm is not None:
                writer.writerow({**base, "column": "kernels.mm", "status": sr.kernels_mm.status,
                                 **{f"km_{k}": v for k, v in _flat(asdict(sr.kernels_mm)).items()}})


def write_plot(report: Report, path: str | Path) -> None:
    """Grouped bars: one group per shape, one bar per column: TFLOP/s on a GPU; without one, how many candidates
    matched the reference (correctness only: no times)."""
    plt = pyplot()
    if report.speed:
        value = lambda cell: cell.tflops if cell.ok else None  # noqa: E731
        ylabel = "TOPS" if report.args.get("dtype") == "int8" else "TFLOP/s"
    else:
        value = lambda cell: cell.verified if cell.candidates else None  # noqa: E731
        ylabel = "candidates verified (correctness only)"
    shapes = report.shapes
    if not shapes:
        raise PlotError("nothing to plot: no shapes were measured")
    cols = list(report.columns)
    width = 0.8 / max(len(cols), 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(shapes) * max(1, len(cols)) / 2), 4.5))
    for j, c in enumerate(cols):
        xs, ys = [], []
        for i, sr in enumerate(shapes):
            cell = sr.cells.get(c)
            if cell is not None and value(cell) is not None:
                xs.append(i + (j - (len(cols) - 1) / 2) * width)
                ys.append(value(cell))
        ax.bar(xs, ys, width=width, label=c)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([sr.label() for sr in shapes], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title(report)[:110], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
