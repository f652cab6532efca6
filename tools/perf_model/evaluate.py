"""Offline evaluation of a performance model on a dataset: per problem, the Spearman rank correlation of predicted vs
measured times, and the regret of benchmarking only the model's top k (the best measured time among the top k over
the best measured time among all timed candidates of the same backends) -- for the model alone, and as tuning runs
it, with aten's time on both sides (tuning always benchmarks aten beside the model's picks)."""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from kernels.space import perf_learned
from kernels.space.perf_model import AnalyticModel
from kernels.space.ranking import top_k
from tools.perf_model.data import Row


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for t in range(i, j + 1):
            ranks[order[t]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation with ties averaged; nan for fewer than 2 points or constant input."""
    if len(xs) < 2:
        return float("nan")
    rx, ry = _ranks(xs), _ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy) if vx > 0 and vy > 0 else float("nan")


@dataclass
class ProblemScore:
    label: str
    candidates: int
    spearman: float
    regret: float          # best of top-k / best overall (1.0 = found the best)
    best: str
    picked: str
    # as tuning runs it: aten is always benchmarked beside the top k, so best of (top-k + aten) / best of (all + aten)
    regret_tuned: float | None = None


@dataclass
class Score:
    model: str
    top_k: int
    problems: list[ProblemScore]

    @property
    def geomean_regret(self) -> float:
        return geomean([p.regret for p in self.problems])

    @property
    def worst_regret(self) -> float:
        return max((p.regret for p in self.problems), default=float("nan"))

    @property
    def tuned(self) -> list[float]:
        return [p.regret_tuned for p in self.problems if p.regret_tuned is not None]

    @property
    def geomean_regret_tuned(self) -> float:
        return geomean(self.tuned)

    @property
    def worst_regret_tuned(self) -> float:
        return max(self.tuned, default=float("nan"))

    @property
    def mean_spearman(self) -> float:
        vals = [p.spearman for p in self.problems if not math.isnan(p.spearman)]
        return sum(vals) / len(vals) if vals else float("nan")

    @property
    def reduction(self) -> float:
        """How many times fewer candidates are built and benchmarked (mean candidates / k)."""
        vals = [p.candidates / min(self.top_k, p.candidates) for p in self.problems]
        return sum(vals) / len(vals) if vals else float("nan")

    def summary(self) -> str:
        tuned = (f"; with aten benchmarked beside them (as tuning does, {len(self.tuned)} problems) geomean "
                 f"{self.geomean_regret_tuned:.3f}x worst {self.worst_regret_tuned:.3f}x" if self.tuned else "")
        return (f"{self.model:>9}: {len(self.problems)} problems, top-{self.top_k} regret geomean "
                f"{self.geomean_regret:.3f}x worst {self.worst_regret:.3f}x, mean Spearman {self.mean_spearman:.3f}, "
                f"{self.reduction:.1f}x fewer candidates{tuned}")


def _label(r: Row) -> str:
    p = r.problem
    return f"{p.op} {p.dtype} {p.m}x{p.n}x{p.k} {p.stride_a}{p.stride_b}"


def group_by_problem(rows: list[Row]) -> dict[str, list[Row]]:
    """Timed, non-aten rows by problem (the candidates a model ranks)."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        if r.ms is not None and r.choice.backend != "aten":
            groups[_label(r)].append(r)
    return dict(groups)


def aten_by_problem(rows: list[Row]) -> dict[str, float]:
    """The fastest timed aten row per problem: the baseline tuning always benchmarks, whatever the model says."""
    best: dict[str, float] = {}
    for r in rows:
        if r.ms is not None and r.choice.backend == "aten":
            best[_label(r)] = min(r.ms, best.get(_label(r), math.inf))
    return best


def score(model, rows: list[Row], k: int, analytic_share: float | None = None, ensemble: str | None = None) -> Score:
    """Each problem's top k as tuning picks them (kernels.space.ranking.top_k), scored against all measured."""

    share = analytic_share
    name = model.name if model.name == "analytic" or share is None else f"{model.name}+{share:.0%}a"
    result = Score(name + (f"/{ensemble}" if ensemble and model.name != "analytic" else ""), k, [])
    aten = aten_by_problem(rows)
    for label, group in sorted(group_by_problem(rows).items()):
        if len(group) < 2:
            continue
        problem = group[0].problem
        pred = model.predict(problem, [r.choice for r in group])
        pairs = [(p, r) for p, r in zip(pred, group) if p is not None]
        if len(pairs) < 2:
            continue
        measured = [r.ms for _, r in pairs]
        rho = spearman([p for p, _ in pairs], measured)
        top = top_k(model, problem, [r.choice for _, r in pairs], k, share, ensemble)
        picked = min(top, key=lambda i: measured[i])
        best = min(range(len(pairs)), key=lambda i: measured[i])
        base = aten.get(label)
        tuned = None if base is None else min(measured[picked], base) / min(measured[best], base)
        result.problems.append(ProblemScore(label, len(pairs), rho, measured[picked] / measured[best],
                                            pairs[best][1].choice.name, pairs[picked][1].choice.name, tuned))
    return result


def problem_key(row: Row) -> tuple:
    """What makes two dataset rows the same problem, for holding problems out."""
    p = row.problem
    return (p.op, p.dtype, p.m, p.n, p.k)


def cv_fold(job) -> list[tuple[str, float]]:
    """One leave-one-problem-out fold (`python -m tools.perf_model cv`): fit on every other problem, then (scheme,
    regret) on the left-out one for the analytic model and each analytic share x ensemble pick. A module-level
    function, so spawned worker processes can import it (from `python -m kernels` it would live in __main__)."""

    rows, gpu, left_out, fit_args, top_k, shares, ensembles = job
    train = [(r.problem, r.choice, r.ms) for r in rows
             if problem_key(r) != left_out and r.ms is not None and r.choice.backend != "aten"]
    params = perf_learned.fit(train, perf_learned.default_meta(gpu, "cv", "-"), **fit_args)
    learned = perf_learned.LearnedModel(params, "cv")
    held = [r for r in rows if problem_key(r) == left_out]
    scores = [score(AnalyticModel(), held, top_k)] + [score(learned, held, top_k, s, e)
                                                       for s in shares for e in ensembles]
    return [(s.model, s.problems[0].regret) for s in scores if s.problems]
