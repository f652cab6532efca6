"""The learned performance model: a small ensemble of MLPs (torch, CPU, float64; the members differ only in their
seed and their predictions of log time are averaged) from features of the problem, the candidate's tile and the
analytic model's estimate. One MLP's top-5 on held-out int8 problems moved from 1.23x to 2.36x worst regret with the
seed alone; averaging takes that variance out. Parameters are JSON (kernels/data/perf_model_*.json) with
the GPU, versions, dataset and date they came from; a model is only used for that GPU and Triton minor version.

Training is reproducible: fixed seed, float64, one CPU thread, full-batch Adam.
"""
from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Sequence
from importlib import metadata, resources
from pathlib import Path

import torch

from kernels.core.choice import Choice
from kernels.core.fsutil import MAX_JSON_BYTES, atomic_write_text, read_regular
from kernels.core.problem import GemmProblem
from kernels.space.perf_model import AnalyticModel, estimate_of, gpu_spec, tile_of

KIND = "kernels-perf-mlp"
VERSION = 2
BASE_FEATURES = ("log_m", "log_n", "log_k", "log_block_m", "log_block_n", "log_block_k", "stages", "log_warps",
                 "log_group_m", "log_split_k", "wgmma", "elem_bytes", "out_bytes", "log_tiles", "log_waves",
                 "wave_efficiency", "log_blocks_per_sm", "log_k_iters", "smem_fraction", "m_util", "n_util",
                 "k_util", "mma_fraction", "log_analytic_ms", "a_ld_aligned", "b_ld_aligned")


def _log2(x: float) -> float:
    return math.log2(max(x, 1e-12))


def problem_features(problem: GemmProblem) -> tuple:
    """What `features` needs of the problem alone: computed once per problem when ranking thousands of choices."""

    return (gpu_spec(problem.arch, problem.device_name), _log2(problem.m), _log2(problem.n), _log2(problem.k),
            float(problem.elem_bytes), float(problem.out_bytes),
            # a leading dimension off 16 bytes costs vector loads (int8 1234x4321x2345: a 10x spread the tile
            # features alone did not see)
            float(problem.leading_dim_aligned("a")), float(problem.leading_dim_aligned("b")))


def features(problem: GemmProblem, choice: Choice, per_problem: tuple | None = None) -> list[float] | None:
    """BASE_FEATURES for one candidate; None when it has no tile (aten). `per_problem`: problem_features(problem),
    where the caller has it."""

    tile = tile_of(problem, choice)
    if tile is None:
        return None
    spec, log_m, log_n, log_k, elem_bytes, out_bytes, a_aligned, b_aligned = per_problem or problem_features(problem)
    est = estimate_of(problem, tile)
    m, n, k = problem.m, problem.n, problem.k
    return [log_m, log_n, log_k, _log2(tile.block_m), _log2(tile.block_n), _log2(tile.block_k),
            float(tile.stages), _log2(tile.warps), _log2(tile.group_m), _log2(tile.split_k), float(tile.wgmma),
            elem_bytes, out_bytes, _log2(est.tiles), _log2(est.waves),
            est.wave_efficiency, _log2(est.blocks_per_sm), _log2(est.k_iters),
            est.smem_bytes / spec.smem_per_sm, m / (-(-m // tile.block_m) * tile.block_m),
            n / (-(-n // tile.block_n) * tile.block_n), k / (est.k_iters * tile.block_k * tile.split_k),
            est.mma_fraction, math.log(est.ms), a_aligned, b_aligned]


def _minor(version: str) -> str:
    return ".".join(str(version).split(".")[:2])


def _triton_version() -> str:
    try:
        return metadata.version("triton")
    except Exception:  # noqa: BLE001
        return "absent"


class LearnedModel:
    name = "learned"

    def __init__(self, params: dict, path: str = ""):
        self.params = params
        self.path = path
        self.meta = params.get("meta", {})
        if not (isinstance(self.meta, dict) and all(isinstance(self.meta.get(k, ""), str) for k in ("gpu", "triton"))):
            raise ValueError("meta must be an object whose gpu and triton are strings")
        self.templates = list(params["templates"])
        if list(params["features"]) != list(BASE_FEATURES) + [f"template={t}" for t in self.templates]:
            raise ValueError("feature list differs from this version of kernels")
        self._mean = torch.tensor(params["x_mean"], dtype=torch.float64)
        self._std = torch.tensor(params["x_std"], dtype=torch.float64)
        if not (torch.isfinite(self._mean).all() and torch.isfinite(self._std).all() and (self._std > 0).all()):
            raise ValueError("x_mean and x_std must be finite, x_std positive")
        self._members = [[(torch.tensor(layer["w"], dtype=torch.float64),
                           torch.tensor(layer["b"], dtype=torch.float64)) for layer in member]
                         for member in params["members"]]
        self._y = (float(params["y_mean"]), float(params["y_std"]))
        self.winners = [(tuple(w["class"]), tuple(w["mnk"]), w["winner"]) for w in params.get("winners", ())]

    def stale_for(self, problem: GemmProblem) -> str:
        """'' when this model was trained on the problem's GPU with this Triton minor version, else why not."""
        gpu = self.meta.get("gpu", "")
        if gpu.strip().lower() != problem.device_name.strip().lower():
            return f"trained on {gpu or 'an unknown GPU'}, this is {problem.device_name}"
        if _minor(self.meta.get("triton", "")) != _minor(_triton_version()):
            return f"trained with triton {self.meta.get('triton')}, this is triton {_triton_version()}"
        return ""

    def knows(self, choice: Choice) -> bool:
        """Whether this model predicts the choice itself (aten and templates it was not trained on get the analytic
        estimate)."""
        return choice.backend != "aten" and choice.template in self.templates

    def unseen(self, choices: Sequence[Choice]) -> int:
        """How many of the choices (aten aside) are of templates this model was not trained on."""
        return sum(1 for c in choices if c.backend != "aten" and not self.knows(c))

    def neighbour_winners(self, problem: GemmProblem, neighbours: int) -> list[str]:
        """The fastest measured choice of each of the `neighbours` training problems nearest to `problem` (same
        problem_class; distance in log2 M, N, K), nearest first."""
        cls, here = problem_class(problem), (_log2(problem.m), _log2(problem.n), _log2(problem.k))
        near = sorted((math.dist(here, tuple(map(_log2, mnk))), mnk, winner) for c, mnk, winner in self.winners
                      if c == cls)
        return [winner for _, _, winner in near[:neighbours]]

    def vector(self, problem: GemmProblem, choice: Choice, per_problem: tuple | None = None) -> list[float] | None:
        base = features(problem, choice, per_problem)
        if base is None:
            return None
        return base + [1.0 if choice.template == t else 0.0 for t in self.templates]

    def predict(self, problem: GemmProblem, choices: Sequence[Choice]) -> list[float | None]:
        """Learned times (the members' geometric mean) for templates it was trained on; the analytic estimate for
        the others."""
        where, log_ms = self._learned_log_ms(problem, choices)
        return _filled(self._analytic_rest(problem, choices, where), where, log_ms.mean(0).exp().tolist())

    def predict_members(self, problem: GemmProblem, choices: Sequence[Choice]) -> list[list[float | None]]:
        """One list of times per member, as `predict` (top_k ranks by the fastest member)."""
        where, log_ms = self._learned_log_ms(problem, choices)
        rest = self._analytic_rest(problem, choices, where)
        return [_filled(rest, where, member) for member in log_ms.exp().tolist()]

    @staticmethod
    def _analytic_rest(problem: GemmProblem, choices: Sequence[Choice], where: list[int]) -> list[float | None]:
        """The analytic estimate of the choices not at `where` (None there): only those are estimated, as a new
        shape ranks thousands of choices."""

        out: list[float | None] = [None] * len(choices)
        rest = sorted(set(range(len(choices))) - set(where))
        for i, v in zip(rest, AnalyticModel().predict(problem, [choices[i] for i in rest]) if rest else []):
            out[i] = v
        return out

    def _learned_log_ms(self, problem: GemmProblem, choices: Sequence[Choice]):
        """(indices of the choices this model predicts, their log milliseconds per member [members, len(indices)])."""

        rows, where = [], []
        per_problem = problem_features(problem)
        for i, c in enumerate(choices):
            v = self.vector(problem, c, per_problem) if c.template in self.templates else None
            if v is not None:
                rows.append(v)
                where.append(i)
        if not rows:
            return [], torch.zeros(len(self._members), 0, dtype=torch.float64)
        with torch.no_grad():
            return where, self.forward_members(torch.tensor(rows, dtype=torch.float64))

    def forward_members(self, x):
        """Log milliseconds for a batch of feature rows, one row of outputs per member: [members, rows]."""
        xn = (x - self._mean) / self._std
        outs = []
        for layers in self._members:
            h = xn
            for j, (w, b) in enumerate(layers):
                h = h @ w + b
                if j < len(layers) - 1:
                    h = torch.nn.functional.silu(h)
            outs.append(h[:, 0] * self._y[1] + self._y[0])
        return torch.stack(outs)


def _filled(base: list[float | None], where: list[int], values: list[float]) -> list[float | None]:
    """A copy of `base` with `values` at the indices `where`."""
    out = list(base)
    for i, v in zip(where, values):
        out[i] = v
    return out


# -- training ------------------------------------------------------------------------------------------------------
def problem_class(problem: GemmProblem) -> tuple:
    """What two problems must share for one's measured winners to be a candidate list for the other: the op, the
    dtypes, the layouts and whether each leading dimension is 16-byte aligned (which decides the templates that
    apply)."""
    return (problem.op, problem.dtype, problem.out_dtype, problem.layout_a, problem.layout_b,
            int(problem.leading_dim_aligned("a")), int(problem.leading_dim_aligned("b")))


def winners_of(rows: list[tuple[GemmProblem, Choice, float]]) -> list[dict]:
    """Per training problem (class and M, N, K), the name of its fastest measured choice (a choice timed in several
    files counts at its fastest; ties by name), in a stable order."""
    fastest: dict[tuple, dict[str, float]] = {}
    for problem, choice, ms in rows:
        if choice.backend == "aten" or not (ms > 0):
            continue
        times = fastest.setdefault((problem_class(problem), (problem.m, problem.n, problem.k)), {})
        times[choice.name] = min(ms, times.get(choice.name, math.inf))
    return [{"class": list(cls), "mnk": list(mnk), "winner": min(times, key=lambda n: (times[n], n))}
            for (cls, mnk), times in sorted(fastest.items())]


def fit(rows: list[tuple[GemmProblem, Choice, float]], meta: dict, *, seed: int = 0, steps: int = 1500,
        hidden: int = 48, lr: float = 3e-3, weight_decay: float = 1e-4, members: int = 5) -> dict:
    """Parameters of `members` MLPs (seeds seed, seed+1, ...) fitted to (problem, choice, measured ms). Same data +
    seed -> same parameters."""

    templates = sorted({c.template for _, c, _ in rows if c.backend != "aten"})
    names = list(BASE_FEATURES) + [f"template={t}" for t in templates]
    xs, ys = [], []
    for problem, choice, ms in rows:
        base = features(problem, choice)
        if base is None or not (ms > 0):
            continue
        xs.append(base + [1.0 if choice.template == t else 0.0 for t in templates])
        ys.append(math.log(ms))
    if len(xs) < 8:
        raise ValueError(f"need at least 8 timed candidates with a tile to fit, got {len(xs)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.tensor(xs, dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64)
        mean, std = x.mean(0), x.std(0, unbiased=False)
        std = torch.where(std > 1e-9, std, torch.ones_like(std))
        y_mean, y_std = float(y.mean()), float(y.std(unbiased=False)) or 1.0
        xn, yn = (x - mean) / std, (y - y_mean) / y_std
        sizes = [x.shape[1], hidden, hidden, 1]
        trained = [_train_member(xn, yn, sizes, seed + i, steps, lr, weight_decay) for i in range(members)]
    finally:
        torch.set_num_threads(threads)
    rmse = math.sqrt(sum(loss for _, loss in trained) / len(trained)) * y_std
    return {"kind": KIND, "version": VERSION, "meta": dict(meta, rows=len(xs), seed=seed, steps=steps,
                                                             hidden=hidden, members=members,
                                                             train_rmse_log=round(rmse, 6)),
            "features": names, "templates": templates, "x_mean": mean.tolist(), "x_std": std.tolist(),
            "y_mean": y_mean, "y_std": y_std, "members": [layers for layers, _ in trained],
            "winners": winners_of(rows)}


def _train_member(xn, yn, sizes: list[int], seed: int, steps: int, lr: float, weight_decay: float):
    """(layers as JSON lists, final mean squared error in normalised units) of one full-batch Adam fit."""

    gen = torch.Generator().manual_seed(seed)
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        w = (torch.rand(a, b, generator=gen, dtype=torch.float64) * 2 - 1) * math.sqrt(3.0 / a)
        params += [w.requires_grad_(), torch.zeros(b, dtype=torch.float64, requires_grad=True)]
    opt = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        h = xn
        for j in range(0, len(params), 2):
            h = h @ params[j] + params[j + 1]
            if j < len(params) - 2:
                h = torch.nn.functional.silu(h)
        loss = torch.mean((h[:, 0] - yn) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    layers = [{"w": params[j].detach().tolist(), "b": params[j + 1].detach().tolist()}
              for j in range(0, len(params), 2)]
    return layers, float(loss.detach())


def save(params: dict, path: str | os.PathLike) -> None:
    atomic_write_text(Path(path), json.dumps(params, indent=None, separators=(",", ":")) + "\n")


def load(path: str | os.PathLike) -> tuple[LearnedModel | None, str]:
    """The model at `path`, or (None, why not). Never raises."""
    try:
        params = json.loads(read_regular(Path(path), MAX_JSON_BYTES))     # a FIFO or a device is refused, not read
        if params.get("kind") != KIND or params.get("version") != VERSION:
            return None, f"not a {KIND} v{VERSION} file"
        return LearnedModel(params, str(path)), ""
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {e}"


def default_meta(gpu: str, dataset: str, dataset_sha256: str, arch: int = 0) -> dict:
    return {"gpu": gpu, "arch": arch, "triton": _triton_version(), "torch": torch.__version__,
            "dataset": dataset, "dataset_sha256": dataset_sha256, "trained": time.strftime("%Y-%m-%d", time.gmtime())}


@functools.lru_cache(maxsize=1)
def _shipped() -> tuple[LearnedModel, ...]:
    models = []
    data = resources.files("kernels").joinpath("data")
    for entry in sorted(data.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("perf_model_") and entry.name.endswith(".json"):
            model, _ = load(str(entry))
            if model is not None:
                models.append(model)
    return tuple(models)


def shipped_for(problem: GemmProblem) -> tuple[LearnedModel | None, list[str]]:
    """The first model in kernels/data/perf_model_*.json fresh for this problem, else (None, why each is stale)."""
    reasons = []
    for model in _shipped():
        why = model.stale_for(problem)
        if not why:
            return model, []
        reasons.append(f"{Path(model.path).name}: {why}")
    return None, reasons
