"""Ranking candidates with the performance models: which model serves a problem (`model_for`) and which k
candidates a top-k benchmark space builds (`top_k`: learned picks, an analytic share, a family hedge, one place for
unseen templates and one for the nearest training problem's measured winner)."""
from __future__ import annotations

from collections.abc import Sequence

from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.problem import GemmProblem
from kernels.space import perf_learned
from kernels.space.perf_model import AnalyticModel, PerfModel

# -- which model -----------------------------------------------------------------------------------------------------
# With a learned model, 2 of every 5 places go to the analytic model's favourites. Chosen by leave-one-problem-out
# cross-validation on the training sets only (`python -m tools.perf_model cv`, 5-member ensembles ranked as below): top-5
# regret (geomean / worst) on H200 bf16 (16 problems) 1.036 / 1.377 with 2 analytic places, 1.037 / 1.377 with 1,
# 1.073 / 1.448 with none; on H100 bf16 (16) 1.001 / 1.014 with 2 or 1, 1.003 / 1.046 with none.
ANALYTIC_SHARE = 0.4
# ...but not for int8: on the H100 int8 training set (30 problems) the analytic model's rank correlation is 0.32 (bf16:
# 0.65); in cross-validation 2 analytic places gave 1.012 / 1.068, none 1.009 / 1.062. Re-run with int8 warpgroup MMA
# only for a K-major B in the analytic model, the hedge and the unseen-template place (`model cv --dtypes int8
# --shares 0,0.2,0.4 --ensembles mean`, 37 min on 2 cores): none 1.008 / 1.062, 1 place 1.010 / 1.100, 2 places
# 1.012 / 1.141.
ANALYTIC_SHARE_BY_DTYPE = {"int8": 0.0}
# A learned ensemble ranks by the members' mean (top_k, "mean"). Ranking by the fastest member's prediction
# ("optimistic": where members disagree the shape is unlike the training problems) won the same cross-validation
# (shares as above): H100 int8 1.009 / 1.062 against 1.020 / 1.384, almost all of it one problem (int8
# 1000x3000x2000, where one member put the padded template's winner first); H100 bf16 1.001 / 1.014 against
# 1.016 / 1.266; H200 bf16 1.036 / 1.377 against 1.038 / 1.377. On the held-out problems it lost everywhere: H100
# int8 1.032 / 1.339 against 1.028 / 1.275, H100 bf16 1.012 / 1.204 against 1.002 / 1.016, H200 bf16 1.024 / 1.328
# against 1.013 / 1.233 (the minimum of 5 noisy predictions favours the noisiest). `model cv --ensembles` compares both.
ENSEMBLE_PICKS = "mean"
# A model's errors are shared within a template family (one code path: misaligned loads, a pipeline shape the
# training data barely covered), so the fastest-predicted choice of the second-fastest family gets a place when it is
# predicted within HEDGE_RATIO of the fastest. End to end on the H100 (fast preset over the exhaustive space) the
# int8 model's top 5 for 1500^3 were five `triton_int8_mm` tiles at 80 us and more, none of them in its training data,
# where the dataset's `triton_padded_int8_mm` ran 35 us (predicted 1.6x the favourite). It takes one of the learned
# places. On the measured candidates of the held-out sets: H100 bf16 1.002 / 1.016 -> 1.004 / 1.050 (3072^3, where
# aten is as fast: 1.001 / 1.016 with aten beside them either way), H100 int8 and H200 bf16 unchanged.
HEDGE_FAMILIES = 2
HEDGE_RATIO = 2.0
# The MLP interpolates poorly between its ~90 training problems: for int8 4000x4000x320 it predicted 60.9 us for the
# tile measured at 38.5 us (and moving K from 320 to 256 moved its BK=128 predictions from 39 to 68 us), so its top 5
# held none of the fast tiles (1.125x the full exhaustive optimum on the H100). The measured winners of the nearest
# training problems are a prior that needs no interpolation: NEIGHBOUR_PLACES of the top k go to the winners of the
# NEIGHBOURS nearest training problems of the same class (perf_learned.problem_class), the nearest first, out of the
# analytic share while that keeps one place (bf16: 1 analytic, 1 neighbour, 3 learned; int8: 1 neighbour, 4 learned).
# Top-5 regret (geomean / worst, aten beside the picks) on H100 held-out problems with every exhaustive candidate timed
# (tools/perf_model/data/h100_heldout_full_*.csv.gz): int8 (9 problems) 1.025 / 1.125 -> 1.010 / 1.048; bf16 (6) 1.010 / 1.060
# before and after. Two places taken from the learned ones put bf16 4096x128x4096 at 1.120 (its
# second-ranked learned pick was the optimum); ordering the winners by the model's prediction instead of by distance
# moved with the neighbour count (1.014 / 1.010 / 1.028 for 2 / 3 / 5): it trusts the model where it is wrong. On the
# sampled held-out sets: int8 1.009 / 1.084 before and after, bf16 1.002 / 1.029 -> 1.0015 / 1.029.
NEIGHBOURS = 3
NEIGHBOUR_PLACES = 1


def analytic_share_for(problem: GemmProblem) -> float:
    return ANALYTIC_SHARE_BY_DTYPE.get(problem.dtype, ANALYTIC_SHARE)


def top_k(model: PerfModel, problem: GemmProblem, choices: Sequence[Choice], k: int,
          analytic_share: float | None = None, ensemble: str | None = None,
          pred: Sequence[float | None] | None = None) -> list[int]:
    """Indices of the k choices to build and benchmark. With the analytic model: its fastest predictions, and a place
    for the second family's best where it is close (family_heads, HEDGE_*). With a learned model: the same from its
    predictions over the templates it was trained on, a share of the places for the analytic model's favourites (its
    errors are different ones; default per dtype, analytic_share_for), and one place for the best of the templates it
    has not seen where the analytic model puts that within HEDGE_RATIO of the learned favourite (the learned model
    predicts those by the analytic estimate, another scale than its own), and NEIGHBOUR_PLACES for the measured winners
    of the training problems nearest to this one (neighbour_picks). `ensemble` says how a learned ensemble
    ranks: "optimistic" (by its fastest member's prediction) or "mean" (by the members' mean); default
    ENSEMBLE_PICKS. `pred`: the model's predictions for `choices`, where the caller has them."""
    if analytic_share is None:
        analytic_share = analytic_share_for(problem)
    if pred is None:
        pred = model.predict(problem, choices)
    ranked = _fastest_first(pred)
    if model.name == "analytic" or k < 2:
        return _merge(family_heads(choices, pred, HEDGE_FAMILIES, HEDGE_RATIO) if k > 1 else [], ranked, k)
    scores = pred
    if (ensemble or ENSEMBLE_PICKS) == "optimistic" and hasattr(model, "predict_members"):
        scores = optimistic(model.predict_members(problem, choices))
    knows = getattr(model, "knows", lambda choice: True)
    trained = [knows(c) for c in choices]
    known = [s if t else None for s, t in zip(scores, trained)]
    if all(s is None for s in known):
        return top_k(AnalyticModel(), problem, choices, k)
    learned = _fastest_first(known)
    # the analytic estimate of every choice only where it has a share of the places; otherwise of the unseen
    # templates and the learned favourite alone (a new shape ranks thousands of choices)
    needed = range(len(choices)) if analytic_share > 0 else sorted({i for i, t in enumerate(trained) if not t}
                                                                   | {learned[0]})
    analytic: list[float | None] = [None] * len(choices)
    for i, ms in zip(needed, AnalyticModel().predict(problem, [choices[i] for i in needed])):
        analytic[i] = ms
    unseen_ms = [ms if c.backend != "aten" and not t else None for ms, c, t in zip(analytic, choices, trained)]
    unseen = [i for i in _fastest_first(unseen_ms) if unseen_ms[i] is not None][:1]
    if not (unseen and analytic[learned[0]] is not None and unseen_ms[unseen[0]] <= HEDGE_RATIO * analytic[learned[0]]):
        unseen = []
    n_analytic = max(1, round(analytic_share * k)) if analytic_share > 0 else 0
    nearby = neighbour_picks(model, problem, choices, NEIGHBOUR_PLACES) if k > 2 else []
    # the neighbours' places come out of the analytic share while it has more than one
    from_analytic = min(len(nearby), max(0, n_analytic - 1))
    n_analytic -= from_analytic
    places = max(1, k - n_analytic - len(unseen) - len(nearby))
    picked = _merge(family_heads(choices, known, HEDGE_FAMILIES, HEDGE_RATIO), learned, places) + unseen
    # the analytic share goes to trained templates too: the unseen ones have had their one place
    analytic_known = [ms if t else None for ms, t in zip(analytic, trained)]
    fill = ([i for i in _fastest_first(analytic_known) if analytic_known[i] is not None] if analytic_share > 0 else [])
    return _merge(picked + nearby, fill + learned + ranked, k)


def neighbour_picks(model: PerfModel, problem: GemmProblem, choices: Sequence[Choice], places: int) -> list[int]:
    """Indices of at most `places` distinct choices that won one of the NEIGHBOURS training problems nearest to
    `problem` (a learned model's memory of its data), the nearest problem's first."""
    winners = getattr(model, "neighbour_winners", None)
    if winners is None:
        return []
    index = {c.name: i for i, c in enumerate(choices)}
    found: list[int] = []
    for name in winners(problem, NEIGHBOURS):
        if name in index and index[name] not in found:
            found.append(index[name])
    return found[:places]


def family_heads(choices: Sequence[Choice], pred: Sequence[float | None], families: int, ratio: float) -> list[int]:
    """The fastest-predicted choice of each of the `families` fastest template families, where predicted within
    `ratio` of the fastest prediction (indices, fastest first)."""
    heads: list[int] = []
    seen: set[str] = set()
    ranked = _fastest_first(pred)
    for i in ranked:
        if pred[i] is None or len(seen) >= families:
            break
        if choices[i].template in seen:
            continue
        seen.add(choices[i].template)
        if pred[i] <= pred[ranked[0]] * ratio:
            heads.append(i)
    return heads


def _merge(first: Sequence[int], then: Sequence[int], k: int) -> list[int]:
    """`first`, then `then` in order, without repeats, k at most."""
    out: list[int] = []
    for i in list(first) + list(then):
        if len(out) >= k:
            break
        if i not in out:
            out.append(i)
    return out


def _fastest_first(pred: Sequence[float | None]) -> list[int]:
    """Indices by predicted time; choices without a prediction last."""
    return sorted(range(len(pred)), key=lambda i: (pred[i] is None, pred[i] or 0.0, i))


def optimistic(members: Sequence[Sequence[float | None]]) -> list[float | None]:
    """Per choice, the fastest of the members' predictions (None where they have none): a choice any member
    expects to be fast gets timed, where ranking by their mean times only what they agree on."""
    return [None if any(t is None for t in ts) else min(ts) for ts in zip(*members)]


def model_for(problem: GemmProblem) -> tuple[PerfModel, str]:
    """The model `kernels.config.perf_model` asks for, and a note when it is not the one asked for (stale or
    missing learned model -> analytic)."""
    wanted = config.perf_model
    if wanted == "analytic":
        return AnalyticModel(), ""
    if wanted.endswith(".json"):
        model, why = perf_learned.load(wanted)
        if model is None:
            return AnalyticModel(), f"learned model {wanted} unusable ({why}); ranked by the analytic model"
        stale = model.stale_for(problem)
        if stale:
            return AnalyticModel(), f"learned model {wanted} is stale ({stale}); ranked by the analytic model"
        return model, ""
    model, reasons = perf_learned.shipped_for(problem)
    if model is not None:
        return model, ""
    if reasons:
        return AnalyticModel(), ("no fresh learned model (" + "; ".join(reasons) + "); ranked by the analytic model")
    if wanted == "learned":
        return AnalyticModel(), "no learned model is installed; ranked by the analytic model"
    return AnalyticModel(), ""
