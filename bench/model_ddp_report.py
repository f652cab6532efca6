"""bench.model_ddp's records and table, pure functions of what the ranks measured: the first step's wall time and
kernels.stats() counters per rank, ms per step per round, global tokens/s, speedup over eager, and patch's difference
from eager after the first step. No process group here: the unit tests feed it fake figures."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from bench.cli_common import number_cell, print_tables, rate_cell
from bench.cli_common import read_run as read_run_file
from bench.model_report import STATS

# kernels.stats() counters the table shows per rank (the JSON keeps every counter that moved)
SHOWN_COUNTERS = {"tunes": "tunes", "disk_hits": "disk", "compiles": "compiles", "cpu_fallbacks": "cpu fallbacks",
                  "store_hits": "shared"}


@dataclass
class DdpVariantResult:
    """One variant of one run, every rank's figures together (rank 0 assembles it from what each rank measured)."""
    variant: str                                    # eager | patch
    status: str                                     # ok | error
    world_size: int
    tokens: int                                     # M of each rank's input; the global batch is tokens * world_size
    message: str = ""
    stat: str = "median"
    cold_s: float | None = None                     # the first step's wall time, the slowest rank's
    cold_s_by_rank: list[float] = field(default_factory=list)
    cold_stats_by_rank: list[dict] = field(default_factory=list)   # kernels.stats() counters that moved, per rank
    loss_by_rank: list[float] = field(default_factory=list)        # the first step's loss (each rank's own input)
    rounds_ms: list[float] = field(default_factory=list)           # ms per step, one value per round
    loops_s: list[float] = field(default_factory=list)             # each timing loop's length
    eager_ms: float | None = None
    loss_err: float | None = None                   # |loss - eager's| / |eager's| after the first step, worst rank
    grad_err: float | None = None                   # max|g - eager's| / max|eager's|, worst parameter (after the
    grad_err_param: str = ""                        # all-reduce: the same on every rank) and its name

    @property
    def ms(self) -> float | None:
        return STATS[self.stat](self.rounds_ms) if self.status == "ok" and self.rounds_ms else None

    def total(self, counter: str) -> int:
        """A counter summed over the ranks' first steps (tunes: one per distinct problem when the ranks share)."""
        return sum(s.get(counter, 0) for s in self.cold_stats_by_rank)

    def derived(self) -> dict:
        ms = self.ms
        return {"ms": ms,
                "tokens_per_s": None if ms is None else self.tokens * self.world_size / (ms * 1e-3),
                "speedup": None if ms is None or self.eager_ms is None else self.eager_ms / ms,
                "first_step_tunes": self.total("tunes")}

    def to_json(self) -> dict:
        return {"kind": "variant", **asdict(self), **self.derived()}

    @classmethod
    def from_json(cls, data: dict) -> DdpVariantResult:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


# -- the table ------------------------------------------------------------------------------------------------------
HEADERS = ("variant", "ranks", "cold s", "cold s by rank", "first step, by rank", "ms/step", "tokens/s (all ranks)",
           "vs eager", "loss err", "grad err", "note")


def counters_cell(stats_by_rank: list[dict]) -> str:
    """'r0: 12 tunes, 0 disk; r1: 0 tunes, 12 disk' — the shown counters any rank moved, for every rank."""
    moved = [key for key in SHOWN_COUNTERS if any(s.get(key) for s in stats_by_rank)]
    if not moved:
        return "-"
    return "; ".join(f"r{rank}: " + ", ".join(f"{s.get(key, 0)} {SHOWN_COUNTERS[key]}" for key in moved)
                     for rank, s in enumerate(stats_by_rank))


def _note(r: DdpVariantResult) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.message}"[:160]
    parts = []
    if r.total("tunes"):
        parts.append(f"{r.total('tunes')} tunes over all ranks")
    if r.grad_err_param:
        parts.append(f"worst grad {r.grad_err_param}")
    return ", ".join(parts)


def table_row(r: DdpVariantResult) -> list[str]:
    d = r.derived()
    speed = "-" if d["speedup"] is None else f"{d['speedup']:.3f}x"
    by_rank = " / ".join(f"{s:.2f}" for s in r.cold_s_by_rank) or "-"
    return [r.variant, str(r.world_size), number_cell(r.cold_s, ".2f"), by_rank, counters_cell(r.cold_stats_by_rank),
            number_cell(d["ms"], ".4f"), rate_cell(d["tokens_per_s"]), speed, number_cell(r.loss_err, ".2e"),
            number_cell(r.grad_err, ".2e"), _note(r)]


def plain_table(results: list[DdpVariantResult], title: str) -> str:
    rows = [list(HEADERS)] + [table_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    return "\n".join([title] + ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows])


def print_table(results: list[DdpVariantResult], title: str, file=None) -> None:
    print_tables(title, [(HEADERS, [table_row(r) for r in results])], lambda: plain_table(results, title), file)


def table_title(run: dict) -> str:
    devices = run.get("devices") or ["?"]
    names = devices[0] if len(set(devices)) == 1 else ", ".join(devices)
    return (f"bench.model_ddp: {run.get('world_size', '?')} x {names} ({run.get('backend', '?')}, "
            f"{run.get('launcher', '?')}): hidden {run.get('hidden', '?')}, intermediate {run.get('intermediate', '?')}"
            f", {run.get('layers', '?')} layer(s), {run.get('dtype', '?')}, M = {run.get('tokens', '?')} per rank; "
            f"forward+backward under DistributedDataParallel; {run.get('rounds', '?')} rounds of "
            f"{run.get('seconds', '?')} s loops per variant, alternated, {run.get('stat', 'median')} over rounds.\n"
            f"cold s: the first step's wall time (patch: tuning every forward and backward problem), the slowest "
            f"rank's; first step: kernels.stats() counters that moved in it; loss err / grad err: patch's first-step "
            f"loss and all-reduced grads against eager's, relative")


def read_run(path: str) -> tuple[dict, list[DdpVariantResult]]:
    return read_run_file(path, "bench.model_ddp", "variant", DdpVariantResult.from_json)
