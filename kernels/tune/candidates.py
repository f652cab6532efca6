"""The one narrowing stage between `backend.choices()` and building: what of the searched candidates is compiled and
benchmarked.

In order, per backend:
1. the lookup table (`kernels.config.lut`): its choices for the problem join the candidates (`add`) or replace them
   (`only`); each must still be a supported choice of this backend for this problem;
2. name filters (`kernels.config.only` / `skip`, regexes, re.search), never applied to aten (the baseline);
3. the benchmark space (`kernels.config.benchmark_space`): `all`; `default` (as many as the backend's default list);
   an integer k (the performance model's top k); `sample:N` (the default list plus N chosen by a stable hash of the
   name: the same names on every shape, for collecting training data); `explore:N` (the default list, the model's
   top N/2 and the rest of N by a hash salted with the problem: training data where the model ranks, and beyond the
   names `sample` always draws). Lookup-table choices are always kept.
Dropped candidates are summarized in notes (counts), not listed one by one; lookup-table choices that cannot run are
listed with the reason.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from backends import get_backend
from kernels.core.choice import Choice, name_filter
from kernels.core.config import config
from kernels.core.problem import GemmProblem
from kernels.space import lut as lut_mod
from kernels.space.families import backend_of
from kernels.space.heuristics import supports
from kernels.space.ranking import model_for, top_k


@dataclass
class Narrowed:
    kept: list[Choice]
    skipped: dict[str, str] = field(default_factory=dict)     # name -> reason, for Selection.timings
    notes: list[str] = field(default_factory=list)            # for Selection.notes
    filtered: int = 0                                         # left out by KERNELS_ONLY / KERNELS_SKIP


def narrow(problem: GemmProblem, backend_name: str, choices: list[Choice]) -> Narrowed:
    """Never raises: on an internal error every candidate is kept and a note says why."""
    try:
        return _narrow(problem, backend_name, list(choices))
    except Exception as e:  # noqa: BLE001 - narrowing is an optimisation; tuning must go on without it
        return Narrowed(list(choices), {}, [f"{backend_name}: candidate narrowing failed ({type(e).__name__}: {e}); "
                                            "benchmarking every candidate"])


def _narrow(problem: GemmProblem, backend_name: str, choices: list[Choice]) -> Narrowed:
    out = Narrowed([])
    pinned, only = _from_lut(problem, backend_name, choices, out)
    pinned_names = {c.name for c in pinned}
    rest = [] if only else [c for c in choices if c.name not in pinned_names]
    if only and pinned:
        left_out = sum(1 for c in choices if c.name not in pinned_names)
        if left_out:
            out.notes.append(f"{backend_name}: lookup table entry is 'only': {left_out} other candidate(s) not built")
    pinned, rest = _name_filter(backend_name, pinned, out), _name_filter(backend_name, rest, out)
    rest = _benchmark_space(problem, backend_name, rest, out)
    out.kept = pinned + [c for c in rest if c.name not in pinned_names]
    return out


# -- 1. lookup table -------------------------------------------------------------------------------------------------
def _from_lut(problem, backend_name, choices, out: Narrowed) -> tuple[list[Choice], bool]:
    """(the table's choices for this backend, whether they are the only candidates)."""

    table, _ = lut_mod.active()
    match = table.lookup(problem) if table is not None else None
    if match is None:
        return [], False
    refs = [r for r in match.choices if backend_of(r.template_name) == backend_name]
    if not refs:
        if match.mode == "only":
            out.notes.append(f"{backend_name}: lookup table entry {list(match.entries)} is 'only' and names none of "
                             f"this backend's choices: {len(choices)} candidate(s) not built")
            return [], True
        return [], False
    resolved: list[Choice] = []
    pool = None
    by_name = {c.name: c for c in choices}
    for ref in refs:
        choice = by_name.get(ref.name) if ref.name else None
        why = ""
        if choice is None:
            if pool is None:
                pool = _pool(problem, backend_name, choices)
            choice, why = _resolve(problem, backend_name, ref, pool)
        if choice is None:
            out.skipped[ref.label] = f"lookup table choice not usable here: {why}"
        elif choice not in resolved:
            resolved.append(choice)
    where = f"lookup table {table.source} entry {list(match.entries)}"
    if not resolved:
        out.notes.append(f"{backend_name}: none of the {where} choices can run this problem; using the usual "
                         "candidates")
        return [], False
    out.notes.append(f"{backend_name}: {len(resolved)} choice(s) from {where} ({match.mode})")
    return resolved, match.mode == "only"


def _pool(problem, backend_name, choices) -> dict[str, Choice]:
    """Every choice the backend supports for the problem (its exhaustive space) plus those already proposed."""

    pool = {c.name: c for c in choices}
    try:
        extra, _ = get_backend(backend_name).choices(problem, "exhaustive")
        for c in extra:
            pool.setdefault(c.name, c)
    except Exception:  # noqa: BLE001 - resolve against what we have
        pass
    return pool


def _resolve(problem, backend_name, ref, pool) -> tuple[Choice | None, str]:
    if ref.name:
        hit = pool.get(ref.name)
        return (hit, "") if hit is not None else (None, f"{ref.name} is not a supported {backend_name} choice for "
                                                        f"{problem.short()}")
    choice = Choice(backend_name, ref.template, problem.dtype, ref.config, ref.params)
    if choice.name in pool:
        return pool[choice.name], ""
    if ref.config is None:
        return None, f"{choice.name} is not a supported {backend_name} choice for {problem.short()}"
    ok, why = supports(problem, ref.template, ref.config)
    return (choice, "") if ok else (None, why)


# -- 2. name filters -------------------------------------------------------------------------------------------------
def _name_filter(backend_name: str, choices: list[Choice], out: Narrowed) -> list[Choice]:
    only, skip = config.only, config.skip
    if backend_name == "aten" or not (only or skip) or not choices:
        return choices
    keep = name_filter(only, skip)
    kept = [c for c in choices if keep(c.name)]
    if len(kept) < len(choices):
        out.filtered += len(choices) - len(kept)
        out.notes.append(f"{backend_name}: {len(choices) - len(kept)} candidate(s) left out by KERNELS_ONLY/"
                         f"KERNELS_SKIP ({', '.join(only) or '-'} / {', '.join(skip) or '-'})")
    return kept


# -- 3. benchmark space ----------------------------------------------------------------------------------------------
def _benchmark_space(problem, backend_name, choices: list[Choice], out: Narrowed) -> list[Choice]:
    space = config.benchmark_space
    if space == "all" or len(choices) <= 1:
        return choices
    if isinstance(space, str) and space.startswith("sample:"):
        return _sample(problem, backend_name, choices, int(space.split(":")[1]), out)
    if isinstance(space, str) and space.startswith("explore:"):
        return _explore(problem, backend_name, choices, int(space.split(":")[1]), out)
    k = _default_count(problem, backend_name, choices) if space == "default" else int(space)
    if len(choices) <= k:
        return choices

    model, why = model_for(problem)
    pred = model.predict(problem, choices)
    picked = top_k(model, problem, choices, k, pred=pred)
    picked, swapped = _prefer_built(problem, backend_name, choices, picked, pred)
    kept = [choices[i] for i in sorted(picked)]
    blend = " (a share of them the analytic model's)" if model.name != "analytic" else ""
    note = (f"{backend_name}: benchmarking {k} of {len(choices)} candidates, the {model.name} model's top {k}{blend} "
            f"(benchmark space {space})")
    if swapped:
        note += (f"; {swapped} replaced by an already built choice of the same template predicted within "
                 f"{WARM_TIE:.0%}")
    unseen = model.unseen(choices) if hasattr(model, "unseen") else 0
    if unseen:
        note += (f"; {unseen} of templates the learned model was not trained on: at most one place, the analytic "
                 "estimate's best")
    out.notes.append(note + (f"; {why}" if why else ""))
    return kept


# A new M with the same N and K shifts the predictions a little and the top k with them (split counts and tiles follow
# M), so tuning it compiled up to 10 kernels on the H100 (0.2-0.3 s each) where built ones predicted as fast were
# at hand. Within this margin a prediction is a coin flip: the built choice takes the place.
WARM_TIE = 0.03


def _prefer_built(problem, backend_name, choices, picked: list[int], pred) -> tuple[list[int], int]:
    """`picked` with each pick the backend has not built replaced by the best-predicted built choice of the same
    template predicted within WARM_TIE of it (never one already picked); and how many were replaced."""

    near: dict[int, list[int]] = {}
    for i in picked:
        if pred[i] is None:
            continue
        near[i] = sorted((j for j, c in enumerate(choices) if j not in picked and pred[j] is not None
                          and c.template == choices[i].template and abs(pred[j] / pred[i] - 1.0) <= WARM_TIE),
                         key=lambda j: pred[j])
    if not any(near.values()):
        return picked, 0
    asked = sorted({i for i in near if near[i]} | {j for js in near.values() for j in js})
    built = get_backend(backend_name).built(problem, [choices[i] for i in asked])
    out, swapped = list(picked), 0
    for pos, i in enumerate(picked):
        if choices[i].name in built:
            continue
        alt = next((j for j in near.get(i, ()) if choices[j].name in built and j not in out), None)
        if alt is not None:
            out[pos] = alt
            swapped += 1
    return out, swapped


def _default_count(problem, backend_name, choices) -> int:
    if config.search_space == "default":
        return len(choices)

    return max(1, len(get_backend(backend_name).choices(problem, "default")[0]))


def _sample(problem, backend_name, choices, count, out: Narrowed) -> list[Choice]:
    defaults = {c.name for c in get_backend(backend_name).choices(problem, "default")[0]}
    drawn = _drawn(choices, defaults, count)
    kept = [c for c in choices if c.name in defaults | drawn]
    out.notes.append(f"{backend_name}: benchmarking {len(kept)} of {len(choices)} candidates (the default list plus "
                     f"{len(drawn)} sampled by name hash; benchmark space sample:{count})")
    return kept


def _drawn(choices: list[Choice], excluded: set[str], count: int, salt: str = "") -> set[str]:
    """Names of `count` choices outside `excluded`, first by a stable hash of the name (salted: `salt|name`)."""
    key = (lambda c: hashlib.sha256(f"{salt}|{c.name}".encode()).hexdigest()) if salt else \
        (lambda c: hashlib.sha256(c.name.encode()).hexdigest())
    return {c.name for c in sorted((c for c in choices if c.name not in excluded), key=key)[:max(0, count)]}


def fingerprint_extra() -> dict:
    """What narrowing adds to the selection fingerprint, only where it differs from the defaults (so stores written
    before it existed stay valid)."""
    extra: dict = {}
    if config.benchmark_space != "all":
        extra["benchmark_space"] = str(config.benchmark_space)
        extra["perf_model"] = config.perf_model
    if config.lut:
        extra["lut"] = lut_mod.active()[1] or "unreadable"
    if config.only or config.skip:
        extra["only"], extra["skip"] = list(config.only), list(config.skip)
    return extra


def _explore(problem, backend_name, choices, count, out: Narrowed) -> list[Choice]:
    """The default list, the performance model's top count/2 and count - count/2 others by a hash salted with the
    problem. Why: `sample` draws the same names on every shape (a hash of the name alone), so the H100 int8 data held
    520 of ~2700 configs and the model's favourites on new shapes were configs it had never seen timed (1024x8192x512:
    five unseen `triton_int8_mm` tiles predicted 28-32 us, the best measured 27.8 us ranked 71st). Timing the model's
    own top picks teaches it where it is wrong; the salted draw covers the rest of the space over many problems."""

    defaults = {c.name for c in get_backend(backend_name).choices(problem, "default")[0]}
    model, why = model_for(problem)
    ranked = top_k(model, problem, choices, max(1, count // 2))
    favourites = {choices[i].name for i in ranked}
    drawn = _drawn(choices, defaults | favourites, count - len(favourites), salt=problem.key())
    chosen = defaults | favourites | drawn
    kept = [c for c in choices if c.name in chosen]
    out.notes.append(f"{backend_name}: benchmarking {len(kept)} of {len(choices)} candidates (the default list, the "
                     f"{model.name} model's top {len(favourites)} and {len(drawn)} drawn by a hash salted with the "
                     f"problem; benchmark space explore:{count}){f'; {why}' if why else ''}")
    return kept
