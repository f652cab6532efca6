"""The process's selections: problem -> Selection, and a launcher per (problem, device). A cold lookup goes memory ->
selection store -> tune, once across processes (the store's lock). The api's warm table and dynamic dispatch both
resolve problems here."""
from __future__ import annotations

import threading

import torch

from backends import get_backend
from kernels.core import counters as _stats
from kernels.core.config import config
from kernels.core.fsutil import load_or_build
from kernels.core.problem import GemmProblem
from kernels.core.selection import Selection
from kernels.store.selections import SelectionStore, store_key
from kernels.tune.autotune import fingerprint, tune

lock = threading.RLock()          # guards this module's tables and the api's warm table
_selections: dict[GemmProblem, Selection] = {}
_launchers: dict[tuple[GemmProblem, int], object] = {}    # (problem, device index) -> launch
_store = SelectionStore()


def launcher_for(problem: GemmProblem):
    """The launcher for the problem on the current device (callers enter the tensors' device first): a launcher
    holds device-bound state (loaded functions, workspaces), so a second GPU gets its own, from the same selection."""
    where = (problem, torch.cuda.current_device() if problem.device == "cuda" else -1)
    with lock:
        launch = _launchers.get(where)
        if launch is None:
            sel, launch = _select(problem)
            _selections[problem] = sel
            _launchers[where] = launch
        return launch


def _select(problem: GemmProblem) -> tuple[Selection, object]:
    """Disk, else tune (once across processes: the store's lock). Returns the selection and a ready launcher."""
    backends = tuple(config.backends) or ("aten",)
    key = store_key(problem, fingerprint(backends))

    def build() -> tuple[Selection, object]:
        sel, runners = tune(problem, backends)
        _store.put(key, sel)
        return sel, runners[sel.winner].launch

    return load_or_build(lambda: _load_stored(key, problem), lambda: _store.lock(key), build)


def _load_stored(key: str, problem: GemmProblem):
    sel = _store.get(key)
    if sel is None:
        return None
    choice = sel.winner_choice
    try:
        outcome = get_backend(choice.backend).build(problem, [choice])[0]
    except Exception:  # noqa: BLE001 - an unloadable winner means: tune again
        return None
    if outcome.runner is None:
        return None
    _stats.bump("disk_hits")
    return sel, outcome.runner.launch


def selection(problem: GemmProblem) -> Selection | None:
    """The Selection this process holds for the problem, or None (nothing looked up yet)."""
    with lock:
        return _selections.get(problem)


def clear() -> None:
    with lock:
        _selections.clear()
        _launchers.clear()
