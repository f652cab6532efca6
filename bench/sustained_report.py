"""bench.sustained's figures and table, as pure functions of what its loops measured (ms per call, one value per
round): speedup, regret against the finalists, whether the tuner's ranking agrees with the loops', geomeans, and the
rows printed (rich when importable, plain text otherwise). No GPU here: the unit tests feed it fake loop results, and
`--table-from` re-renders a saved run."""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

from bench.cli_common import number_cell, print_tables
from bench.cli_common import read_run as read_run_file
from bench.report import fmt_ms, ratio
from kernels.core.selection import Selection

TIMED_S = 1.0             # the timed tail of every loop: issue 27's "mean of its last second"
AGREE_GAP = 0.05          # the regime check compares finalist pairs whose loops differ by at least this
# how many candidates are looped for the regret: the final round's (a duel meets one challenger), then the fastest
# other timed ones; all of them when the Selection records no final round
LOOPED_FINALISTS = 4
FINAL_ROUND_KEYS = ("final_ms", "retimed_ms")    # a finalist's time in the tuner's final round, newest format first


STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "min": min}


def loop_ms(rounds: list[float], stat: str) -> float:
    return STATS[stat](rounds)


def speedup(kernels_rounds: list[float], torch_rounds: list[float], stat: str) -> float:
    """torch's loop time / kernels' loop time: above 1 kernels is faster."""
    return loop_ms(torch_rounds, stat) / loop_ms(kernels_rounds, stat)


def regret(loops: dict[str, list[float]], winner: str, stat: str) -> tuple[float | None, str | None]:
    """(winner's loop ms / the best finalist's - 1, the best finalist), or (None, None) when the winner was not
    looped or nothing was looped beside it."""
    if winner not in loops or len(loops) < 2:
        return None, None
    ms = {name: loop_ms(r, stat) for name, r in loops.items()}
    best = min(ms, key=ms.get)
    return ms[winner] / ms[best] - 1.0, best


@dataclass
class RankCheck:
    """Whether the tuner's times order the finalists as the loops do, on the pairs the loops separate by at least
    `gap`. `disagreements`: the pairs the tuner ordered otherwise, each as (faster in the loops, slower in them)."""
    source: str                    # the tuner's measurement compared: final_ms, retimed_ms or timings (finalists())
    pairs: int = 0
    agreeing: int = 0
    disagreements: list[tuple[str, str]] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.pairs == 0:
            return "n/a"
        if self.agreeing == self.pairs:
            return f"yes ({self.pairs})"
        return f"no ({self.agreeing}/{self.pairs})"


def rank_agreement(loop: dict[str, float], tuner: dict[str, float], source: str, gap: float = AGREE_GAP) -> RankCheck:
    check = RankCheck(source)
    names = sorted(n for n in loop if n in tuner)
    for i, x in enumerate(names):
        for y in names[i + 1:]:
            fast, slow = (x, y) if loop[x] <= loop[y] else (y, x)
            if loop[slow] / loop[fast] - 1.0 < gap:
                continue
            check.pairs += 1
            if tuner[fast] < tuner[slow]:
                check.agreeing += 1
            else:
                check.disagreements.append((fast, slow))
    return check


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def finalists(selection: Selection) -> tuple[list[str], dict[str, float], str]:
    """The candidates looped for the regret, fastest first, with the tuner's final-round times for those it has: the
    names whose details hold "final_ms" (kernels.tune.final_round, either regime), else "retimed_ms" (selections
    stored before it), then the fastest other timed candidates up to LOOPED_FINALISTS (with their first-pass times
    only when there was no final round). The winner is always among them. Returns (names, tuner ms by name, which of
    those measurements it is)."""
    tuner, source = {}, "timings"
    for key in FINAL_ROUND_KEYS:
        tuner = {n: float(d[key]) for n, d in selection.details.items()
                 if isinstance(d, dict) and isinstance(d.get(key), (int, float)) and n in selection.choices}
        if tuner:
            source = key
            break
    if not tuner:
        tuner = dict(selection.ranked()[:LOOPED_FINALISTS])
    names = sorted(tuner, key=tuner.get)
    names += [n for n, _ in selection.ranked() if n not in tuner][:max(0, LOOPED_FINALISTS - len(names))]
    if selection.winner not in names:
        names.insert(0, selection.winner)
    return names, tuner, source


# -- one problem's record: what was measured (JSON) and what follows from it (the table) ----------------------------
@dataclass
class ProblemResult:
    problem: str
    dtype: str
    status: str                                    # ok | error | skipped
    message: str = ""
    scaling: str = ""                              # e4m3: "tensor" or "row" scales (its geomean is per scaling)
    winner: str = ""
    regime: str | None = None                      # Selection.regime, where the tuner records it
    tuned: bool = False                            # the first call tuned (else its selection came from disk)
    first_call_s: float | None = None              # wall time of the first call: the cost of a new problem
    # then its calls back to back until its duel on calls was decided (KERNELS_DUEL=calls; None: none was pending)
    duel_s: float | None = None
    duel_calls: int = 0
    tune_s: float | None = None                    # Selection.tune_seconds
    unavailable: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stat: str = "median"
    seconds: float = 0.0                           # each loop's length (its last TIMED_S timed)
    kernels_rounds_ms: list[float] = field(default_factory=list)
    torch_rounds_ms: list[float] = field(default_factory=list)
    finalist_source: str = ""                      # finalists(): which tuner times tuner_ms holds
    tuner_ms: dict[str, float] = field(default_factory=dict)
    finalist_rounds_ms: dict[str, list[float]] = field(default_factory=dict)
    finalist_failures: dict[str, str] = field(default_factory=dict)

    @property
    def measured(self) -> bool:
        return bool(self.kernels_rounds_ms and self.torch_rounds_ms)

    def derived(self) -> dict:
        """The figures the table shows, from the rounds above (recomputable from the JSON line)."""
        out: dict = {"kernels_ms": None, "torch_ms": None, "speedup": None, "regret": None, "best_finalist": None,
                     "regime_check": None, "regime_agrees": "n/a"}
        if self.measured:
            out["kernels_ms"] = loop_ms(self.kernels_rounds_ms, self.stat)
            out["torch_ms"] = loop_ms(self.torch_rounds_ms, self.stat)
            out["speedup"] = speedup(self.kernels_rounds_ms, self.torch_rounds_ms, self.stat)
        out["regret"], out["best_finalist"] = regret(self.finalist_rounds_ms, self.winner, self.stat)
        if self.finalist_rounds_ms:
            loops = {n: loop_ms(r, self.stat) for n, r in self.finalist_rounds_ms.items()}
            check = rank_agreement(loops, self.tuner_ms, self.finalist_source)
            out["regime_check"] = asdict(check)
            out["regime_agrees"] = check.verdict
        return out

    def to_json(self) -> dict:
        return {"kind": "problem", **asdict(self), **self.derived()}

    @classmethod
    def from_json(cls, data: dict) -> ProblemResult:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


HEADERS = ("problem", "winner", "regime", "tune s", "kernels ms", "torch ms", "speedup", "regret", "regime agrees")


def _ms(x: float | None) -> str:
    return "-" if x is None else fmt_ms(x)


def table_row(r: ProblemResult) -> list[str]:
    if r.status != "ok":
        return [r.problem, f"{r.status}: {r.message}"[:100]] + [""] * (len(HEADERS) - 2)
    d = r.derived()
    tune = number_cell(r.first_call_s, ".2f") + ("" if r.tuned else " (disk)")
    if r.duel_s is not None:        # the duel on the calls after it
        tune += f" + {r.duel_s:.2f} on calls"
    burst = r.finalist_source != "final_ms" and d["regime_agrees"] != "n/a"      # the tuner's times were bursts
    agrees = d["regime_agrees"] + (" burst" if burst else "")
    # times with 4 significant digits and the speedup from them as printed: a reader recomputes what is shown
    return [r.problem, r.winner, r.regime or "-", tune, _ms(d["kernels_ms"]), _ms(d["torch_ms"]),
            ratio(d["torch_ms"], d["kernels_ms"]) if d["speedup"] is not None else "-",
            number_cell(d["regret"], ".1%") + (f" ({len(r.finalist_rounds_ms)})" if d["regret"] is not None else ""),
            agrees]


def geomean_rows(results: list[ProblemResult]) -> list[list[str]]:
    """Per dtype (fp8: per dtype and scaling): the geomean and the lowest speedup over the problems measured."""
    by_dtype: dict[str, list[float]] = {}
    for r in results:
        if r.status == "ok" and r.measured:
            group = " ".join(p for p in (r.dtype, r.scaling) if p)
            by_dtype.setdefault(group, []).append(r.derived()["speedup"])
    return [[dtype, f"{geomean(v):.3f}x", f"{min(v):.3f}x", str(len(v))] for dtype, v in by_dtype.items()]


GEOMEAN_HEADERS = ("dtype", "geomean speedup", "lowest", "problems")


def plain_table(results: list[ProblemResult], title: str) -> str:
    rows = [list(HEADERS)] + [table_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = [title] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    summary = geomean_rows(results)
    if summary:
        sw = [max(len(row[i]) for row in [list(GEOMEAN_HEADERS)] + summary) for i in range(len(GEOMEAN_HEADERS))]
        lines += [""] + ["  ".join(c.ljust(w) for c, w in zip(row, sw)).rstrip()
                         for row in [list(GEOMEAN_HEADERS)] + summary]
    return "\n".join(lines)


def print_table(results: list[ProblemResult], title: str, file=None) -> None:
    """Rich tables when rich is importable, else the plain-text ones."""
    print_tables(title, [(HEADERS, [table_row(r) for r in results]), (GEOMEAN_HEADERS, geomean_rows(results))],
                 lambda: plain_table(results, title), file)


def table_title(run: dict) -> str:
    return (f"kernels vs torch, sustained loops on {run.get('gpu', '?')}: backends {run.get('backends', '?')}; "
            f"{run.get('rounds', '?')} rounds of {run.get('seconds', '?')} s loops alternated, mean of the last "
            f"{TIMED_S:g} s, {run.get('stat', '?')} over rounds.\ntune s: the first call's wall time ((disk): no tune); "
            f"speedup = torch ms / kernels ms; regret = winner / best of (n) finalists - 1; regime agrees: the "
            f"tuner's final-round times ('burst': a burst round's) order the finalists as the loops do, on pairs "
            f"{AGREE_GAP:.0%} apart (pairs)")


def read_run(path: str) -> tuple[dict, list[ProblemResult]]:
    """A saved run's header line and records."""
    return read_run_file(path, "bench.sustained", "problem", ProblemResult.from_json)


