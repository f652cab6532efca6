"""The process's selections: problem -> Selection, and a launcher per (problem, device). A cold lookup goes memory ->
selection store -> shared store (KERNELS_STORE) -> tune, once across processes (the local store's lock) and across
machines (the shared store's lock). The api's warm table and dynamic dispatch both resolve problems here."""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import replace

import torch

from backends import get_backend
from kernels.core import counters as _stats
from kernels.core.cache_root import warn_once
from kernels.core.config import config
from kernels.core.errors import NoCandidateError
from kernels.core.fsutil import load_or_build
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection
from kernels.dispatch.call_duel import NOT_YET, CallDuel, LateEntrants, windows_for
from kernels.measure.call_timer import capturing_on, timer_for
from kernels.measure.steady import plan_for
from kernels.measure.verify import make_inputs, reference, verify_launch
from kernels.store.selections import SelectionStore, store_key
from kernels.store.shared import SharedStore, store_for
from kernels.tune.autotune import child_state, fingerprint, join_unmeasured, tune
from kernels.tune.build_queue import request as request_build
from kernels.tune.final_round import call_duel_result, duel_shape, record_duel

lock = threading.RLock()          # guards this module's tables and the api's warm table
_selections: dict[GemmProblem, Selection] = {}
_launchers: dict[tuple[GemmProblem, int], object] = {}    # (problem, device index) -> launch
_store = SelectionStore()


def launcher_for(problem: GemmProblem, calls_follow: bool = True):
    """The launcher for the problem on the current device (callers enter the tensors' device first): a launcher
    holds device-bound state (loaded functions, workspaces), so a second GPU gets its own, from the same selection.
    `calls_follow`: the launcher will serve the problem's calls, so a duel may be left to them (KERNELS_DUEL=calls);
    False where it will not (dynamic shapes' hint problems: only their selections are read), and then a tune
    runs its duel itself."""
    where = (problem, torch.cuda.current_device() if problem.device == "cuda" else -1)
    with lock:
        launch = _launchers.pop(where, None)
        if launch is not None:
            _launchers[where] = launch            # to the back: the most recently looked up is trimmed last
        else:
            sel, launch = _select(problem, calls_follow)
            _selections[problem] = sel
            _launchers[where] = launch
        return launch


def _select(problem: GemmProblem, calls_follow: bool = True) -> tuple[Selection, object]:
    """Disk, else the shared store, else tune (once across processes: the local store's lock; once across machines:
    the shared store's). Returns the selection and a ready launcher."""
    backends = config.backends
    key = store_key(problem, fingerprint(backends))
    shared = store_for(config.store, config.store_lock_s)

    def build() -> tuple[Selection, object]:
        sel, runners = _tune_or_aten(problem, backends, calls_follow and config.duel == "calls")
        _store.put(key, sel)
        if shared is not None:
            shared.publish(key, sel)
        late = {n: runners.pop(n) for n in sel.unmeasured}        # not verified: for the child only
        return sel, _serving(key, problem, sel, {n: r.launch for n, r in runners.items()}, late)

    def load_local():
        return _load_stored(key, problem, calls_follow)

    if shared is None:
        return load_or_build(load_local, lambda: _store.lock(key), build)

    def load_shared():
        return _load_shared(shared, key, problem, calls_follow)

    found = load_local() or load_shared()
    if found is not None:
        return found
    with _store.lock(key):
        # a process on this machine may have tuned or fetched it meanwhile
        return load_local() or shared.tune_once(key, load_shared, build, config.store_wait)


class BackendsFallbackWarning(UserWarning):
    """The backends setting left aten out, and none of its backends could run a problem: aten served it."""


_fallback_warned: set[tuple[str, ...]] = set()


def _tune_or_aten(problem: GemmProblem, backends: tuple[str, ...], defer: bool):
    """tune(), and where no candidate of `backends` can run the problem and they leave aten out (KERNELS_BACKENDS=
    cutlass before its set is built, padded on an aligned problem), a tune with aten added: a valid call is served,
    never refused for the setting (a new user's probe). The selection says so; tune() alone (bench.compare's
    columns) still reports the backends' own failure."""
    try:
        return tune(problem, backends, defer_duel=defer)
    except NoCandidateError as e:
        if "aten" in backends:
            raise
        first = next(iter(e.failures.items()), ("", "no candidate"))
        why = f"no candidate of {', '.join(backends)} could run {problem.short()} ({first[0]}: {first[1][:200]})"
    if backends not in _fallback_warned:
        _fallback_warned.add(backends)
        warnings.warn(f"kernels: {why}; aten serves such problems (the backends setting leaves it out)",
                      BackendsFallbackWarning, stacklevel=5)
    sel, runners = tune(problem, (*backends, "aten"), defer_duel=defer)
    sel.notes.append(f"{why}: aten added to the tune")
    return sel, runners


def _load_stored(key: str, problem: GemmProblem, calls_follow: bool = True):
    """The stored winner, loaded and verified in this process, or None (tune again)."""
    sel = _store.get(key)
    found = None if sel is None else _ready(sel, problem, key, calls_follow=calls_follow)
    if found is not None:
        _stats.bump("disk_hits")
    return found


def _load_shared(shared: SharedStore, key: str, problem: GemmProblem, calls_follow: bool = True):
    """The shared store's winner, built here if need be (that one choice: no benchmark), verified, and kept in the
    local store (the next process here reads it from disk); or None."""
    sel = shared.get(key)
    found = None if sel is None else _ready(sel, problem, key, build_missing=True, calls_follow=calls_follow)
    if found is not None:
        _store.put(key, found[0])
        _stats.bump("store_hits")
    return found


def _ready(sel: Selection, problem: GemmProblem, key: str, build_missing: bool = False, calls_follow: bool = True):
    """(sel, its winner's launcher) when the winner can serve here, else None (tune again). A stored entry is data
    another process (or machine) wrote: its winner is checked against the float64 reference once per process, like
    a tuning candidate, and an entry tuned while a backend was missing is stale once that backend can serve.
    `build_missing`: compile a winner whose binary is not built here even where builds otherwise go to the
    background (a shared selection is worth one compile: it saves a tune). A selection whose duel was left to calls
    loads its challenger the same way and goes on with the duel here (with KERNELS_DUEL=loop, or no calls to follow
    (`calls_follow`), it is tuned again)."""
    stale = [name for name in sel.unavailable if name in config.backends and _available(name, problem)]
    if stale:
        _warn_once(f"kernels: re-tuning {problem.short()}: tuned while {', '.join(stale)} could not serve, which can "
                   "now")
        return None
    if sel.pending and _settled(sel, problem):
        _warn_once(f"kernels: re-tuning {problem.short()}: tuned while {len(sel.pending)} of its candidates were "
                   "being built in the background, which are done now")
        return None
    if sel.awaiting_calls and config.duel != "calls":
        _warn_once(f"kernels: re-tuning {problem.short()}: its final round was left to calls (KERNELS_DUEL=calls), "
                   f"which KERNELS_DUEL={config.duel} does not run")
        return None
    if sel.awaiting_calls and not calls_follow:
        return None         # a dynamic hint: no calls will run its duel
    launches = {sel.winner: _loaded(sel, sel.winner, "winner", problem, build_missing)}
    if launches[sel.winner] is None:
        return None
    if sel.duel is not None:
        # never compiled for a duel aten mostly wins: a challenger not built here, or failing here, leaves the duel
        # undone here (the winner serves; a shared entry is kept in the local store without its duel)
        challenger = _loaded(sel, sel.duel, "challenger", problem, build_missing=False)
        if challenger is None:
            # kept so (locally): a challenger that fails here would otherwise be built and run at every start
            sel = replace(sel, duel=None, notes=[*sel.notes, f"the duel with {sel.duel} was not run here: it could "
                                                 "not be loaded and verified in this process"])
            _store.put(key, sel)
        else:
            launches[sel.duel] = challenger
    late = _unmeasured_runners(sel, problem) if sel.unmeasured else {}
    missing = [n for n in sel.unmeasured if n not in late]
    if missing:     # not built here (a shared entry), or broken: a later cold lookup tunes again once they are built
        sel = replace(sel, unmeasured=[n for n in sel.unmeasured if n in late],
                      pending=[*sel.pending, *(n for n in missing if n not in sel.pending)],
                      notes=[*sel.notes, f"{len(missing)} candidate(s) left to the calls could not be loaded in this "
                                         "process: measured by a later tune"])
        _store.put(key, sel)
    return sel, _serving(key, problem, sel, launches, late)


def _unmeasured_runners(sel: Selection, problem: GemmProblem) -> dict:
    """The runners of a stored selection's unmeasured candidates, loaded as their backends' build does (CUTLASS
    compiles nothing here unless KERNELS_CUTLASS_BUILD=inline; those that are not built are left out), for the isolated
    child's measurement only."""
    by_backend: dict[str, list] = {}
    for name in sel.unmeasured:
        by_backend.setdefault(sel.choices[name].backend, []).append(sel.choices[name])
    runners = {}
    for name, choices in by_backend.items():
        try:
            outcomes = get_backend(name).build(problem, choices)
        except Exception:  # noqa: BLE001 - what cannot load is not measured here
            continue
        runners.update({o.choice.name: o.runner for o in outcomes if o.runner is not None})
    return runners


def _loaded(sel: Selection, name: str, role: str, problem: GemmProblem, build_missing: bool):
    """The stored `name`'s launcher, built (`build_missing`) or loaded, and verified here; None: tune again."""
    choice = sel.choices[name]
    try:
        backend = get_backend(choice.backend)
        if build_missing:
            backend.prebuild([(problem, [choice])])
        outcome = backend.build(problem, [choice])[0]
    except Exception:  # noqa: BLE001 - an unloadable winner means: tune again
        return None
    if outcome.runner is None:
        return None
    why = verify(outcome.runner.launch, problem)
    if why is not None:
        then = "re-tuning" if role == "winner" else f"its duel is dropped and {sel.winner} serves"
        _warn_once(f"kernels: the stored {role} {name} for {problem.short()} failed verification ({why}); {then}")
        return None
    return outcome.runner.launch


def _serving(key: str, problem: GemmProblem, sel: Selection, launches: dict[str, object], late: dict | None = None):
    """What serves the problem's calls: the winner's launcher, or, while the selection awaits its calls, a CallDuel
    of the winner and its challenger on this device, whose verdict is kept here and in the stores
    (kernels.dispatch.call_duel). With unmeasured candidates (`late`: their runners), the duel first waits for the
    isolated child and joins them (`_join_late`)."""
    if not sel.awaiting_calls:
        return launches[sel.winner]
    device = "cuda" if problem.device == "cuda" else "cpu"
    index = torch.cuda.current_device() if device == "cuda" else None     # the caller entered the tensors' device
    current = {"sel": sel}      # the joined selection replaces it (a new challenger, the child's times)
    entrants = None
    if sel.unmeasured:
        child = _ChildWait(index)
        entrants = LateEntrants(ready=child.ready,
                                join=lambda: _join_late(key, problem, current, late or {}, duel, index, child.state))
    duel = CallDuel(sel.winner, sel.duel, {n: launches[n] for n in (sel.winner, sel.duel) if n is not None},
                    decide=lambda windows, seconds: _duel_verdict(key, problem, current["sel"], duel, windows,
                                                                  seconds, persist=not current.get("local")),
                    fail=lambda name, why: _duel_lost(problem, current["sel"], duel, name, why),
                    timer=timer_for(device, index), windows=windows_for(device),
                    capturing=(lambda: capturing_on(index)) if device == "cuda" else (lambda: False),
                    on_capture=lambda: _warn_once(
                        f"kernels: {problem.short()} was captured in a CUDA graph while its duel ran on its calls: "
                        f"the graph calls {sel.winner} whatever the verdict. Call it outside a graph until "
                        "kernels.stats()['duels_pending'] is 0 first, or set KERNELS_DUEL=loop (the duel in the "
                        "tune)"),
                    late=entrants)
    return duel


class _ChildWait:
    """Late entrants' readiness: the isolated child's state (kernels.tune.autotune.child_state), kept for the join
    that follows (a child that failed is not asked)."""

    def __init__(self, index: int | None):
        self.index, self.state = index, "starting"

    def ready(self) -> bool:
        self.state = child_state(self.index)
        return self.state != "starting"


def _join_late(key: str, problem: GemmProblem, current: dict, runners: dict, duel: CallDuel, index: int | None,
               child: str):
    """The duel's late entrants, measured in the isolated child now that it is up (kernels.tune.autotune.
    join_unmeasured): (the challenger, its launch), kept here and in the stores so that a process that ends before
    the verdict leaves the duel, not the measurement, to the next; None when no challenger came within reach (the
    winner is then decided and kept); NOT_YET when the child has gone meanwhile. A fault here (or a check that could
    not run its call) keeps the outcome in this process only."""
    sel = current["sel"]
    why = None
    try:
        with torch.cuda.device(index) if index is not None else contextlib.nullcontext():  # the duel's device
            found = join_unmeasured(problem, sel, runners, child)
            if found is None:
                return NOT_YET
            joined, runner = found
            if runner is not None:
                # the child verified its own load of the binary; the launch that will run here is checked here too,
                # as a stored challenger is (`_loaded`)
                why = verify(runner.launch, problem)
    except Exception as e:  # noqa: BLE001 - the caller's call goes on with the winner
        _warn_once(f"kernels: the candidates of {problem.short()} left to its calls could not be measured "
                   f"({type(e).__name__}: {e}); {sel.winner} serves in this process")
        kept = replace(_decided_copy(sel), unmeasured=[])
        kept.notes.append("the candidates left to the calls could not be measured here; the winner kept (in this "
                          "process)")
        _keep(problem, duel, kept, verdict=False)
        return None
    if why is not None:
        # a crash is the check's call failing here (memory it could not get), not a wrong result: like a challenger
        # raising on a call (`_duel_lost`), nothing of this process's outcome is stored
        current["local"] = why.startswith("crashed")
        joined.timings[joined.duel] = f"failed verification in the caller: {why}"
        joined.notes.append(f"{joined.duel} failed verification in the caller ({why}); "
                            + (f"{sel.duel} duels instead" if sel.duel else "no duel"))
        joined.duel, runner = sel.duel, None
    persist = not current.get("local")
    if joined.duel is None:
        _keep(problem, duel, joined, verdict=False)
        if persist:
            _persist(key, problem, joined)
        return None
    current["sel"] = joined
    with lock:      # not after clear_memory_cache: no launcher would run this duel any more
        if (kept := _selections.get(problem)) is not None and kept.awaiting_calls:
            _selections[problem] = joined
    if persist:
        _persist(key, problem, joined)
    return joined.duel, runner.launch if runner is not None else duel.launches[joined.duel]


def _duel_verdict(key: str, problem: GemmProblem, sel: Selection, duel: CallDuel, windows: list[float],
                  seconds: float, persist: bool = True) -> str | None:
    """The winner once the duel's windows decide it (kernels.tune.final_round.call_duel_result), kept; else None."""
    plan = plan_for("cuda" if problem.device == "cuda" else "cpu")
    result = call_duel_result(sel.winner, sel.duel, windows, plan, seconds)
    if result is None:
        return None
    decided = _decided_copy(sel)
    decided.winner, why = record_duel(result, decided.timings, decided.details)
    decided.notes.append(f"{why}; regime: {duel_shape(result)} of {plan.window_ms:.0f} ms windows on the caller's "
                         f"calls (the first half untimed), {seconds:.2f} s")
    _keep(problem, duel, decided)
    if persist:
        _persist(key, problem, decided)
    return decided.winner


def _duel_lost(problem: GemmProblem, sel: Selection, duel: CallDuel, name: str, why: str) -> str:
    """A challenger that raised on a caller's call: it loses, and the baseline (the winner) stays, in this process
    only -- the error may be the call's (memory it could not get) rather than the kernel's, so nothing is stored
    and another process runs the duel again."""
    decided = _decided_copy(sel)
    decided.timings[name] = f"crashed in the duel on calls: {why}"
    decided.notes.append(f"steady round: {name} raised on a call of its duel; {sel.winner} kept (in this process)")
    _keep(problem, duel, decided)
    return sel.winner


def _decided_copy(sel: Selection) -> Selection:
    # later than the pending entry whatever the clocks (the shared store keeps the newer of two)
    return replace(sel, timings=dict(sel.timings), details={n: dict(d) for n, d in sel.details.items()},
                   notes=list(sel.notes), duel=None, created=max(time.time(), sel.created + 1e-3), source="tuned")


_on_settled: list = []      # callbacks told after a duel's verdict (the api drops its warm tables)


def on_duel_settled(callback) -> None:
    """Call `callback()` after each verdict of a duel on calls: the warm tables still hold the CallDuel, which then
    delegates to the winner; dropping them lets the next call register the winner's own launcher."""
    if callback not in _on_settled:
        _on_settled.append(callback)


def _keep(problem: GemmProblem, duel: CallDuel, decided: Selection, verdict: bool = True) -> None:
    """The verdict in this process (`verdict`: a duel's; else the winner decided without one): the decided selection
    replaces a pending one (whichever device's lookup made it), the winner's launcher replaces the CallDuel, and the
    warm tables are told."""
    if verdict:
        _stats.bump("call_duels")
    with lock:
        current = _selections.get(problem)
        if (current is None and verdict) or (current is not None and current.awaiting_calls):
            _selections[problem] = decided
        for where, launch in list(_launchers.items()):
            if launch is duel:
                _launchers[where] = duel.launches[decided.winner]
    for callback in list(_on_settled):
        callback()


def _persist(key: str, problem: GemmProblem, decided: Selection) -> None:
    """The verdict in the local store and the shared one. Best effort: a failed write leaves the next process to run
    the duel again, never this caller's call."""
    try:
        _store.put(key, decided)
        shared = store_for(config.store, config.store_lock_s)
        if shared is not None:
            shared.publish(key, decided)
    except Exception as e:  # noqa: BLE001 - the verdict stands in this process whatever the stores do
        _warn_once(f"kernels: the duel's verdict for {problem.short()} was not stored ({type(e).__name__}: {e})")


def _settled(sel: Selection, problem: GemmProblem) -> bool:
    """Whether the choices still being built when `sel` was tuned are settled (built, or failed for good; asked of
    their backends without reading a binary). Those that are not are asked for again: a builder that was killed
    meanwhile is started again, one that runs already has them."""
    by_backend: dict[str, list] = {}
    for name in sel.pending:
        choice = sel.choices[name]
        by_backend.setdefault(choice.backend, []).append(choice)
    settled = True
    for name, choices in by_backend.items():
        try:
            done = name not in config.backends or get_backend(name).settled(problem, choices)
        except Exception:  # noqa: BLE001 - a backend that cannot even load will not build them: re-tune
            done = True
        if not done:
            settled = False
            request_build(problem, choices)
    return settled


def _available(name: str, problem: GemmProblem) -> bool:
    try:
        return get_backend(name).available(problem)[0]
    except Exception:  # noqa: BLE001 - a backend that cannot even load is not available
        return False


def verify(launch, problem: GemmProblem) -> str | None:
    """Why the launch computes a wrong product on fresh inputs with the problem's strides, or None."""
    device = "cuda" if problem.device == "cuda" else "cpu"
    operands = make_inputs(problem, device, seed=int(time.time_ns() % (1 << 31)))
    return verify_launch(launch, problem, operands, reference(problem, *operands))


def _warn_once(text: str) -> None:
    warn_once(text, text, stacklevel=4)


def load_only(problem: GemmProblem) -> str:
    """Ready the problem's stored winner on the current device without ever tuning (kernels.preload): 'memory' when
    this process has it already, 'loaded' when it came from the local store (or the shared one, its winner built
    here), 'missing' when neither has a usable entry (its first call will tune it)."""
    where = (problem, torch.cuda.current_device() if problem.device == "cuda" else -1)
    with lock:
        if where in _launchers:
            return "memory"
    key = store_key(problem, fingerprint(config.backends))
    shared = store_for(config.store, config.store_lock_s)
    found = _load_stored(key, problem) or (shared is not None and _load_shared(shared, key, problem)) or None
    if found is None:
        return "missing"
    with lock:
        _selections[problem], _launchers[where] = found
    return "loaded"


def resolved(problem: GemmProblem):
    """This process's launcher for the problem on the current device, or None: never tunes or loads."""
    where = (problem, torch.cuda.current_device() if problem.device == "cuda" else -1)
    with lock:
        return _launchers.get(where)


def trim(keep: int) -> None:
    """Keep the `keep` most recently looked-up launchers and their selections."""
    with lock:
        for where in list(_launchers)[:max(0, len(_launchers) - keep)]:
            launch = _launchers[where]
            if isinstance(launch, CallDuel) and launch.winner is None:
                continue        # a duel under way: dropped, it would start again at every return, never ending
            del _launchers[where]
        alive = {problem for problem, _ in _launchers}
        for problem in [p for p in _selections if p not in alive]:
            del _selections[problem]


def selection(problem: GemmProblem) -> Selection | None:
    """The Selection this process holds for the problem, or None (nothing looked up yet)."""
    with lock:
        return _selections.get(problem)


def duels_pending() -> int:
    """How many of this process's selections wait on a duel on calls (kernels.dispatch.call_duel)."""
    with lock:
        return sum(sel.awaiting_calls for sel in _selections.values())


def aten_winner(problem: GemmProblem) -> bool:
    """Whether the problem's selection in this process picked aten (the C++ table then calls aten itself)."""
    sel = selection(problem)
    return sel is not None and not sel.awaiting_calls and sel.winner_choice.backend == "aten"


def device_context(t: torch.Tensor):
    """The tensor's CUDA device made current (tunes and launches run there), or nothing for a CPU tensor."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def clear() -> None:
    with lock:
        _selections.clear()
        _launchers.clear()
