"""bench.model's records and table, as pure functions of what was measured (a cold time, ms per step per round, the
numerical differences from eager): ms per step, tokens/s, speedup against eager, geomeans, and the rows printed (rich
when importable, plain text otherwise). No GPU here: the unit tests feed it fake timings, and `--table-from`
re-renders a saved run."""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from bench.cli_common import number_cell, print_tables, rate_cell
from bench.cli_common import read_run as read_run_file

STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}
SMALL_M = 16              # the summary's "M <= 16" geomean: split-K/decomposeK territory (issue 28)


@dataclass
class VariantResult:
    """One (variant, tokens, mode): its first call, its timing loops and its difference from eager."""
    variant: str
    mode: str                                       # fwd | fwdbwd
    tokens: int
    status: str                                     # ok | error | skipped
    message: str = ""
    stat: str = "median"
    cold_s: float | None = None                     # wall time of the first call (compiles, tunes, captures)
    # after it, the steps run until no duel on calls was pending (KERNELS_DUEL=calls: the tunes' duels run on them)
    duel_s: float | None = None
    duel_steps: int = 0
    rounds_ms: list[float] = field(default_factory=list)     # ms per step, one value per round
    eager_ms: float | None = None                   # eager's ms per step in the same run, for the speedup
    out_err: float | None = None                    # max|out - eager's| / max|eager's| (first call's output)
    grad_err: float | None = None                   # the same over every weight grad, the worst one (fwdbwd)
    grad_err_param: str = ""                        # ... and which parameter it is
    cold_stats: dict = field(default_factory=dict)  # kernels.stats() counters that moved during the first call
    loop_stats: dict = field(default_factory=dict)  # ... and during the timing loops (a warm process: no tunes)

    @property
    def ms(self) -> float | None:
        return STATS[self.stat](self.rounds_ms) if self.status == "ok" and self.rounds_ms else None

    def derived(self) -> dict:
        """The figures the table shows, from the fields above (recomputable from the JSON line)."""
        ms = self.ms
        return {"ms": ms,
                "tokens_per_s": None if ms is None else self.tokens / (ms * 1e-3),
                "speedup": None if ms is None or self.eager_ms is None else self.eager_ms / ms}

    def to_json(self) -> dict:
        return {"kind": "variant", **asdict(self), **self.derived()}

    @classmethod
    def from_json(cls, data: dict) -> VariantResult:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


def attach_eager(results: list[VariantResult]) -> None:
    """Give every result of one (tokens, mode) group eager's ms per step from that group."""
    eager = next((r.ms for r in results if r.variant == "eager" and r.ms is not None), None)
    for r in results:
        r.eager_ms = eager


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# -- the table ------------------------------------------------------------------------------------------------------
HEADERS = ("mode", "M", "variant", "cold s", "ms/step", "tokens/s", "vs eager", "out err", "grad err", "note")
SUMMARY_HEADERS = ("mode", "variant", "geomean vs eager", f"M<={SMALL_M}", "lowest", "worst out err",
                   "worst grad err", "Ms")


def _note(r: VariantResult) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.message}"[:120]
    parts = []
    tunes = r.cold_stats.get("tunes")
    if tunes:
        each = f" ({r.cold_s / tunes:.1f} s each)" if r.cold_s else ""
        parts.append(f"{tunes} tunes{each}")
    if r.loop_stats.get("tunes"):
        parts.append(f"{r.loop_stats['tunes']} tunes in the loops")
    if r.grad_err_param:
        parts.append(f"worst grad {r.grad_err_param}")
    return ", ".join(parts)


def table_row(r: VariantResult) -> list[str]:
    d = r.derived()
    speed = number_cell(d["speedup"], ".3f") + ("x" if d["speedup"] is not None else "")
    return [r.mode, str(r.tokens), r.variant, number_cell(r.cold_s, ".2f"), number_cell(d["ms"], ".4f"),
            rate_cell(d["tokens_per_s"]), speed, number_cell(r.out_err, ".2e"), number_cell(r.grad_err, ".2e"),
            _note(r)]


def summary_rows(results: list[VariantResult]) -> list[list[str]]:
    """Per mode and variant other than eager: geomean speedup over the Ms measured, over M <= SMALL_M, the lowest,
    and the worst differences from eager (torch.compile's own beside kernels')."""
    groups: dict[tuple[str, str], list[VariantResult]] = {}
    for r in results:
        if r.variant != "eager" and r.derived()["speedup"] is not None:
            groups.setdefault((r.mode, r.variant), []).append(r)
    rows = []
    for (mode, variant), rs in groups.items():
        speeds = [r.derived()["speedup"] for r in rs]
        small = [r.derived()["speedup"] for r in rs if r.tokens <= SMALL_M]
        outs = [r.out_err for r in rs if r.out_err is not None]
        grads = [r.grad_err for r in rs if r.grad_err is not None]
        rows.append([mode, variant, f"{geomean(speeds):.3f}x", f"{geomean(small):.3f}x" if small else "-",
                     f"{min(speeds):.3f}x", number_cell(max(outs) if outs else None, ".2e"),
                     number_cell(max(grads) if grads else None, ".2e"), ",".join(str(r.tokens) for r in rs)])
    return rows


def _plain(headers, rows) -> list[str]:
    table = [list(headers)] + rows
    widths = [max(len(row[i]) for row in table) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]


def plain_table(results: list[VariantResult], title: str) -> str:
    lines = [title] + _plain(HEADERS, [table_row(r) for r in results])
    summary = summary_rows(results)
    if summary:
        lines += [""] + _plain(SUMMARY_HEADERS, summary)
    return "\n".join(lines)


def print_table(results: list[VariantResult], title: str, file=None) -> None:
    """Rich tables when rich is importable, else the plain-text ones."""
    print_tables(title, [(HEADERS, [table_row(r) for r in results]), (SUMMARY_HEADERS, summary_rows(results))],
                 lambda: plain_table(results, title), file)


def table_title(run: dict) -> str:
    return (f"bench.model on {run.get('gpu', '?')} ({run.get('device', '?')}): hidden {run.get('hidden', '?')}, "
            f"intermediate {run.get('intermediate', '?')}, {run.get('layers', '?')} layer(s), {run.get('dtype', '?')}; "
            f"{run.get('rounds', '?')} rounds of {run.get('seconds', '?')} s loops per variant, alternated, "
            f"{run.get('stat', '?')} over rounds.\ncold s: the first call's wall time (compile, tune, capture); "
            f"vs eager = eager ms / variant ms; out err / grad err: max|x - eager's| / max|eager's| of the output / "
            f"of the worst weight grad" + ("\nCPU: the timings are the CPU's (patch runs torch there unless "
                                           "TRITON_INTERPRET=1), not a GPU's speedups" if run.get("device") == "cpu"
                                           else ""))


def read_run(path: str) -> tuple[dict, list[VariantResult]]:
    """A saved run's header line and records."""
    return read_run_file(path, "bench.model", "variant", VariantResult.from_json)
