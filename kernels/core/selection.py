"""Selection: what tuning a problem produced — the winner, every candidate's time or failure, and provenance."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem

SCHEMA_VERSION = 1
# the times tuning's final round adds to a finalist's details (kernels.tune.final_round)
ROUND_KEYS = ("first_pass_ms", "final_ms", "gpu_ms")


# How `timings` records a candidate the first pass timed but nothing verified, as it could not be a finalist (its
# first-pass timing stays in `details`): kernels.tune.final_round.OnDemandCheck
NOT_VERIFIED = "not verified"
# How `timings` records a candidate left to the problem's calls (`Selection.unmeasured`): measured in the isolated
# child once it is up (kernels.dispatch.selected)
UNMEASURED = "left to the calls"


@dataclass
class Selection:
    problem: GemmProblem
    winner: str                                   # the winning choice's name
    choices: dict[str, Choice]                    # every candidate considered, by name
    timings: dict[str, float | str]               # name -> median ms, or the failure text
    details: dict[str, dict] = field(default_factory=dict)   # name -> p20/p80/rel_error/... for timed ones
    source: str = "tuned"                         # tuned | memory | disk | shared | cpu-fallback
    tune_seconds: float = 0.0
    created: float = 0.0
    fingerprint: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # where tune_seconds went: stage -> seconds (kernels.tune.final_round.StageClock), for `explain` and the benchmarks
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # backends that could not serve when it was tuned: when one of them can, the selection is stale (re-tuned on the
    # next cold lookup, never on a warm call)
    unavailable: list[str] = field(default_factory=list)
    # which final round chose the winner: "steady" (calls >= 0.1 ms, timed with clocks and power settled) or "burst"
    # (shorter calls, short interleaved samples; kernels.tune.final_round)
    regime: str = "burst"
    # choices whose binaries were still being built in the background when it was tuned, or that were left to the
    # calls and could not be loaded where it was resumed: once they are built (or failed for good), the selection is
    # stale the same way (backends.base.Backend.settled)
    pending: list[str] = field(default_factory=list)
    # a challenger whose steady-regime duel with the winner (the baseline, serving meanwhile) runs on the caller's own
    # calls (KERNELS_DUEL=calls, kernels.dispatch.call_duel); None once decided, or where the tune decided it
    duel: str | None = None
    # candidates built but not yet measured, left to the problem's calls because the isolated child that verifies and
    # times them was still starting (a process's first tune: ~5 s of Python and torch); the calls measure them there
    # once it is up, then duel the fastest (KERNELS_DUEL=calls)
    unmeasured: list[str] = field(default_factory=list)

    @property
    def awaiting_calls(self) -> bool:
        """Whether the problem's calls still have work of the tune to do: a duel, or candidates to measure."""
        return self.duel is not None or bool(self.unmeasured)

    @property
    def winner_choice(self) -> Choice:
        return self.choices[self.winner]

    def finalists(self) -> list[str]:
        """The candidates the final round timed side by side (their details hold "final_ms"; their timings are the
        final round's), in no order; [] for a selection without a final round."""
        return [n for n, t in self.timings.items()
                if isinstance(t, float) and isinstance(self.details.get(n), dict) and "final_ms" in self.details[n]]

    def first_pass(self) -> dict[str, float]:
        """Every timed candidate's first-pass ms: finalists carry it in their details, the rest in `timings`, and
        those timed but never verified (NOT_VERIFIED: no final round could take them) in their details' median."""
        out = {}
        for name, t in self.timings.items():
            detail = self.details.get(name)
            detail = detail if isinstance(detail, dict) else {}
            if isinstance(t, float):
                first = detail.get("first_pass_ms", t)
                out[name] = float(first) if isinstance(first, (int, float)) else t
            elif isinstance(t, str) and t.startswith(NOT_VERIFIED):
                median = detail.get("median_ms")
                if isinstance(median, (int, float)):
                    out[name] = float(median)
        return out

    def ranked(self) -> list[tuple[str, float]]:
        """Timed candidates: the final round's fastest first, then the others by their first pass. The two rounds'
        times are not compared: in the steady regime a tile's 40 ms first pass runs up to ~12% ahead of what it does
        in the final round's 1 s windows (a cool chip), so a winner sorted among first-pass times looks slower than
        candidates it beat."""
        final = set(self.finalists())
        timed = [(n, t) for n, t in self.timings.items() if isinstance(t, float)]
        return sorted(timed, key=lambda x: (x[0] not in final, x[1]))

    def regret(self) -> float | None:
        """How much slower the winner ran than the fastest finalist in the final round (0.0 when it was the fastest,
        or the only finalist: no challenger came within reach; the rules may keep a simpler candidate within a tie),
        or None when the winner was not timed in a final round (or a time is 0: a selection made in code)."""
        final = {n: self.timings[n] for n in self.finalists()}
        if self.winner not in final or min(final.values()) <= 0:
            return None
        return final[self.winner] / min(final.values()) - 1.0

    def failures(self) -> dict[str, str]:
        """Candidates that could not be timed, or failed: name -> why (those timed and not verified are not here)."""
        return {n: t for n, t in self.timings.items()
                if isinstance(t, str) and not t.startswith((NOT_VERIFIED, UNMEASURED))}

    def unverified(self) -> dict[str, float]:
        """Candidates the first pass timed that nothing verified (no final round could take them): name -> ms."""
        return {n: t for n, t in self.first_pass().items() if not isinstance(self.timings.get(n), float)}

    def to_dict(self) -> dict:
        return {"schema": SCHEMA_VERSION, "problem": asdict(self.problem), "winner": self.winner,
                "choices": {n: c.as_dict() for n, c in self.choices.items()}, "timings": self.timings,
                "details": self.details, "tune_seconds": self.tune_seconds, "created": self.created,
                "fingerprint": self.fingerprint, "notes": self.notes, "stage_seconds": self.stage_seconds,
                "unavailable": self.unavailable, "regime": self.regime, "pending": self.pending,
                "duel": self.duel, "unmeasured": self.unmeasured}

    @classmethod
    def from_dict(cls, data: dict, source: str) -> "Selection":
        if data.get("schema") != SCHEMA_VERSION:
            raise ValueError(f"selection schema {data.get('schema')!r} != {SCHEMA_VERSION}")
        choices = {n: Choice.from_dict(c) for n, c in data["choices"].items()}
        if data["winner"] not in choices:
            raise ValueError("winner is not among the recorded choices")
        timings = {n: (float(t) if isinstance(t, (int, float)) else str(t)) for n, t in data["timings"].items()}
        return cls(problem=GemmProblem.from_dict(data["problem"]), winner=data["winner"], choices=choices,
                   timings=timings, details=data.get("details", {}), source=source,
                   tune_seconds=float(data.get("tune_seconds", 0.0)), created=float(data.get("created", 0.0)),
                   fingerprint=data.get("fingerprint", {}), notes=list(data.get("notes", [])),
                   stage_seconds={k: float(v) for k, v in data.get("stage_seconds", {}).items()},
                   unavailable=list(data.get("unavailable", [])), regime=str(data.get("regime", "burst")),
                   pending=_names(data, "pending", choices), duel=_duel(data, choices),
                   unmeasured=_unmeasured(data, choices))

    def table(self, rounds: bool = False) -> str:
        """The AUTOTUNE table: timed choices sorted by time with % of best (those never verified marked so), then the
        failures. `rounds`: each timed choice's first-pass, re-timed (final round) and GPU times in us, where tuning
        took them."""
        ranked = self.ranked()
        final = set(self.finalists())
        stages = ", ".join(f"{k} {v:.2f}" for k, v in self.stage_seconds.items())
        # a selection nothing was timed for (the CPU's torch fallback, a zero-size problem) had no final round
        round_ = f"{self.regime} final round, " if self.timings else "nothing timed, "
        if self.awaiting_calls:
            round_ = f"{self.regime} final round pending on calls, "
        lines = [f"AUTOTUNE {self.problem.short()} -> {self.winner} ({self.source}, {round_}"
                 f"{self.tune_seconds:.2f} s{': ' + stages if stages else ''})"]
        # % of the best within its own round: the final round's candidates, then the first pass's others
        unverified = self.unverified()
        groups = [[(n, t) for n, t in ranked if n in final],
                  sorted([(n, t) for n, t in ranked if n not in final] + list(unverified.items()), key=lambda x: x[1])]
        for i, group in enumerate(g for g in groups if g):
            if final and i == 1:
                lines.append("   (first pass only: not timed in the final round, not comparable with it)")
            best = group[0][1]
            for name, t in group:
                mark = "*" if name == self.winner else " "
                d = self.details.get(name, {}) if rounds else {}
                extra = "".join(f"  {key} {d[key] * 1e3:.2f}" for key in ROUND_KEYS if key in d)
                share = f"{100 * best / t:6.1f}%" if t > 0 else "     -"     # a selection made in code may hold a 0
                lines.append(f" {mark} {name:<52} {t * 1e3:10.2f} us  {share}{extra}"
                             + ("  not verified" if name in unverified else ""))
        for name, why in self.failures().items():
            lines.append(f"   {name:<52} {why[:160]}")
        lines.extend(f"   note: {n}" for n in self.notes)
        if self.duel is not None:
            lines.append(f"   note: {self.winner} serves while its duel with {self.duel} runs on this problem's calls")
        if self.unmeasured:
            more = len(self.unmeasured) - 3
            shown = ", ".join(self.unmeasured[:3]) + (f" and {more} more" if more > 0 else "")
            lines.append(f"   note: {len(self.unmeasured)} candidate(s) are measured on this problem's calls once the "
                         f"isolated child is up (it was starting when the problem was tuned): {shown}")
        if self.pending:
            lines.append(f"   note: tuned while {len(self.pending)} candidates were being built in the background or "
                         "could not be measured; re-tuned with them on a cold lookup once they are built")
        return "\n".join(lines)


def _names(data: dict, field_name: str, choices: dict[str, Choice]) -> list[str]:
    """The recorded `pending` or `unmeasured` choices; each must be a recorded choice (their backends are asked
    about them)."""
    names = data.get(field_name, [])
    if not isinstance(names, list) or any(not isinstance(n, str) or n not in choices for n in names):
        raise ValueError(f"{field_name} names a choice that is not recorded")
    if len(set(names)) != len(names):
        raise ValueError(f"{field_name} names a choice twice")
    return list(names)


def _unmeasured(data: dict, choices: dict[str, Choice]) -> list[str]:
    """The recorded choices left to the calls: never the winner or the challenger (those were measured)."""
    names = _names(data, "unmeasured", choices)
    if data.get("winner") in names or (data.get("duel") is not None and data.get("duel") in names):
        raise ValueError("unmeasured names the winner or the challenger")
    return names


def _duel(data: dict, choices: dict[str, Choice]) -> str | None:
    """The recorded challenger awaiting its duel on calls: a recorded choice other than the winner, or None."""
    name = data.get("duel")
    if name is not None and (not isinstance(name, str) or name not in choices or name == data.get("winner")):
        raise ValueError("duel names no recorded challenger")
    return name
