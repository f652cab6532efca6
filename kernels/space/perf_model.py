"""Performance models: predict each candidate's time so a large search space can be cut to the best few.

One interface, `model.predict(problem, choices) -> list[float | None]` (milliseconds; None: the model cannot say),
two implementations:
- `AnalyticModel`: no data. Roofline (peak tensor FLOP/s, HBM bandwidth), wave quantization of the output tiles over
  the SMs (blocks per SM from shared memory, warps and registers), tile efficiency (shared-memory operand traffic per
  MMA, warpgroup MMA on sm90), pipeline depth (how much of the load latency the stages hide), launch latency.
  It ranks; its absolute times are rough.
- `LearnedModel` (kernels/perf_learned.py): a small MLP on features of the problem, the tile and the analytic
  prediction, trained on measured timings; valid only for the GPU and Triton version it was trained on.

`model_for(problem)` picks one per `kernels.config.perf_model` and says why (the note goes to Selection.notes).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kernels.core.choice import Choice
from kernels.space.heuristics import cdiv
from kernels.core.problem import GemmProblem


class PerfModel(Protocol):
    name: str

    def predict(self, problem: GemmProblem, choices: Sequence[Choice]) -> list[float | None]: ...


@dataclass(frozen=True)
class GpuSpec:
    name: str
    sms: int
    tflops: dict            # dense tensor-core peak by dtype key (bf16, fp16, tf32, fp32, int8), TFLOP/s or TOPS
    hbm_tbs: float          # DRAM bandwidth, TB/s
    l2_tbs: float           # L2 -> SM bandwidth, TB/s
    smem_per_sm: int        # bytes of shared memory an SM can hand out
    clock_ghz: float
    launch_us: float = 4.0  # a launch as a user's call sees it (host + device)
    latency_us: float = 0.7  # first global load of a block until its first MMA


# H100 / H200 class (sm90, 132 SMs): the values DESIGN.md uses; A100 class for sm80; others use the sm90 figures.
_SPECS = {
    90: GpuSpec("sm90", 132, {"bf16": 989, "fp16": 989, "tf32": 494, "fp32": 67, "int8": 1979}, 4.27, 10.0,
                233_472, 1.83),
    80: GpuSpec("sm80", 108, {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5, "int8": 624}, 2.0, 5.0,
                167_936, 1.41),
}
REGISTERS_PER_SM = 65_536
MAX_WARPS_PER_SM = 64
SMEM_BYTES_PER_CLOCK = 128
ITERATION_CYCLES = 40          # loop, barrier and address arithmetic per K step


@functools.lru_cache(maxsize=16)
def gpu_spec(arch: int, device_name: str) -> GpuSpec:
    spec = _SPECS.get(arch, _SPECS[90])
    sms = spec.sms
    if arch and device_name != "cpu":
        try:
            import torch
            if torch.cuda.is_available() and torch.cuda.get_device_name(0) == device_name:
                sms = torch.cuda.get_device_properties(0).multi_processor_count
        except Exception:  # noqa: BLE001 - the table's count is a fine fallback
            pass
    return GpuSpec(device_name or spec.name, sms, spec.tflops, spec.hbm_tbs, spec.l2_tbs, spec.smem_per_sm,
                   spec.clock_ghz, spec.launch_us, spec.latency_us)


def dtype_key(problem: GemmProblem) -> str:
    if problem.dtype == "fp32":
        return "fp32" if problem.precision == "ieee" else "tf32"
    return problem.dtype


@dataclass(frozen=True)
class Tile:
    """What the models need to know about a candidate: its output tile, K step, pipeline and warps."""
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    split_k: int = 1          # K split over this many blocks (split-K / decompose-K templates)
    wgmma: bool = False       # sm90 warpgroup MMA (CUTLASS 3.x always; Triton when blocks and warps allow)
    stream_k: bool = False    # work split evenly over SMs: no wave quantization


_SPLIT_PARAMS = ("split", "split_k", "splits", "k_splits", "decompose_k", "k_split")


# Tuning ranks thousands of candidates per new shape (the exhaustive space), and the learned model, its analytic
# fallback and the analytic share of the top k all need the same tiles and estimates: computed once per shape.
_PER_SHAPE_CACHE = 1 << 14


@functools.lru_cache(maxsize=_PER_SHAPE_CACHE)
def tile_of(problem: GemmProblem, choice: Choice) -> Tile | None:
    """The candidate's tile, from its GemmConfig (Triton templates) or its CUTLASS tag; None for aten."""
    params = dict(choice.params)
    split = next((int(params[p]) for p in _SPLIT_PARAMS if isinstance(params.get(p), int) and params[p] > 0), 1)
    if choice.config is not None:
        c = choice.config
        wg = problem.arch >= 90 and c.block_m >= 64 and c.num_warps % 4 == 0 and dtype_key(problem) != "fp32"
        return Tile(c.block_m, c.block_n, c.block_k, c.num_stages, c.num_warps, c.group_m, split, wg)
    if choice.backend == "cutlass" and "" in params:
        try:
            from kernels.space.heuristics_cutlass import CutlassConfig
            cc = CutlassConfig.from_params(choice.params)
        except (ValueError, KeyError):
            return None
        bm, bn = (cc.tile_n, cc.tile_m) if cc.swap else (cc.tile_m, cc.tile_n)
        e = problem.elem_bytes
        stages = cc.stages or max(2, min(8, gpu_spec(problem.arch, problem.device_name).smem_per_sm
                                         // max(1, (cc.tile_m + cc.tile_n) * cc.tile_k * e)))
        warps = cc.warps_m * cc.warps_n if cc.warps_m else 12     # sm90: a producer + two consumer warpgroups
        return Tile(bm, bn, cc.tile_k, stages, warps, max(cc.swizzle, 1), 1, choice.template.startswith("cutlass3x"),
                    cc.stream_k)
    return None


@dataclass(frozen=True)
class Estimate:
    """The analytic model's pieces for one candidate (also features for the learned model)."""
    ms: float
    tiles: int
    blocks_per_sm: int
    waves: int
    wave_efficiency: float     # tiles / (waves * slots)
    k_iters: int
    smem_bytes: int
    mma_fraction: float        # of the SM's MMA peak a tile's inner loop reaches


@functools.lru_cache(maxsize=_PER_SHAPE_CACHE)
def estimate_of(problem: GemmProblem, tile: Tile) -> Estimate:
    """`estimate` on the problem's own GPU spec, remembered per (problem, tile)."""
    return estimate(problem, tile, gpu_spec(problem.arch, problem.device_name))


def estimate(problem: GemmProblem, tile: Tile, spec: GpuSpec) -> Estimate:
    m, n, k = problem.m, problem.n, problem.k
    e = problem.elem_bytes
    bm, bn, bk, s, w = tile.block_m, tile.block_n, tile.block_k, max(tile.stages, 1), max(tile.warps, 1)
    tiles = cdiv(m, bm) * cdiv(n, bn) * tile.split_k
    k_part = cdiv(k, tile.split_k)
    k_iters = max(1, cdiv(k_part, bk))
    smem = e * (bm + bn) * bk * s
    threads = 32 * w
    regs = min(255, 32 + bm * bn // threads + (bm + bn) * bk * e // (4 * threads))
    bps = max(1, min(spec.smem_per_sm // max(smem, 1), MAX_WARPS_PER_SM // w, REGISTERS_PER_SM // (threads * regs),
                     32))
    slots = spec.sms * bps
    if tile.stream_k:
        waves_f = tiles / slots
        waves = max(1, math.ceil(waves_f))
        wave_eff = 1.0
    else:
        waves = cdiv(tiles, slots)
        waves_f = float(waves)
        wave_eff = tiles / (waves * slots)
    peak_sm = spec.tflops[dtype_key(problem)] * 1e12 / spec.sms          # FLOP/s per SM
    # tile efficiency: MMA rate, and the shared-memory traffic that feeds it (operands read once per warp row/column)
    if tile.wgmma:
        mma_rate = 1.0
        groups = max(1, w // 4)
        smem_iter = (bm * bk + bn * bk * groups) * e
    else:
        mma_rate = 0.55 if problem.arch >= 90 else 1.0
        if dtype_key(problem) == "fp32":
            mma_rate = 1.0                                               # CUDA cores: the fp32 peak already says so
        wm = 1 << math.ceil(math.log2(w) / 2)
        wn = max(1, w // wm)
        smem_iter = (bm * bk * wn + bn * bk * wm) * e
    flops_iter = 2.0 * bm * bn * bk
    t_mma = flops_iter / (peak_sm * mma_rate)
    t_smem = smem_iter / (SMEM_BYTES_PER_CLOCK * spec.clock_ghz * 1e9)
    active = max(1, min(tiles, slots))
    t_load = (bm + bn) * bk * e / (spec.l2_tbs * 1e12 / active)
    busy = max(t_mma, t_smem, t_load)
    # pipeline depth: with s stages (and other resident blocks) a load overlaps the MMAs of earlier stages
    hidden = 1.0 - 1.0 / (s * min(bps, 2))
    t_iter = busy + (t_mma + t_load - busy) * (1.0 - hidden) + ITERATION_CYCLES / (spec.clock_ghz * 1e9)
    resident_warps = w * bps
    if resident_warps < 8:                                               # too few warps to cover issue latency
        t_iter *= 1.0 + 0.15 * (8 / resident_warps - 1)
    t_epilogue = bm * bn * problem.out_bytes / (spec.l2_tbs * 1e12 / active)
    t_tile = k_iters * t_iter + t_epilogue
    t_compute = waves_f * bps * t_tile + spec.latency_us * 1e-6 * (1 + (k_iters < s))
    if tile.split_k > 1:                                                 # partial results: written, read, reduced
        t_compute += 2 * tile.split_k * m * n * 4 / (spec.hbm_tbs * 1e12)
    # DRAM: operands re-read across tile columns/rows beyond what L2 reuse (grouped ordering) keeps
    traffic = (m * k * cdiv(n, bn) + k * n * cdiv(m, bm)) * e
    dram = max(problem.min_bytes, traffic / max(1.0, 2.0 * tile.group_m))
    t_dram = dram / (spec.hbm_tbs * 1e12)
    t_floor = problem.flops / (spec.tflops[dtype_key(problem)] * 1e12)
    seconds = max(t_compute, t_dram, t_floor) + spec.launch_us * 1e-6
    frac = t_mma / t_iter if t_iter > 0 else 0.0
    return Estimate(seconds * 1e3, tiles, bps, waves, wave_eff, k_iters, smem, frac)


def library_ms(problem: GemmProblem, spec: GpuSpec) -> float:
    """aten (cuBLAS): assumed to reach 80% of the roofline."""
    t = max(problem.flops / (spec.tflops[dtype_key(problem)] * 1e12), problem.min_bytes / (spec.hbm_tbs * 1e12))
    return (t / 0.8 + spec.launch_us * 1e-6) * 1e3


def pad_copy_ms(problem: GemmProblem, spec: GpuSpec) -> float:
    """What a padded choice adds to its product: both operands read and written once more, in one more launch."""
    moved = 2 * (problem.m * problem.k + problem.k * problem.n) * problem.elem_bytes
    return (moved / (spec.hbm_tbs * 1e12) + spec.launch_us * 1e-6) * 1e3


# Hopper's int8 warpgroup MMA reads B only K-major: templates that copy B K-major get it, a row-major B does not.
# H100 int8 training sets (row-major B): measured over analytic time, median, 1.39x for triton_int8_mm and 1.62x for
# triton_tma_int8_mm (wgmma assumed), 0.98x for triton_kmajor_int8_mm.
_KMAJOR_B_TEMPLATES = ("triton_kmajor_int8_mm", "triton_padded_int8_mm", "triton_padded_tma_int8_mm")


def int8_wgmma(problem: GemmProblem, choice: Choice) -> bool:
    """Whether an int8 choice can use warpgroup MMA (True for other dtypes)."""
    return problem.dtype != "int8" or choice.template in _KMAJOR_B_TEMPLATES or problem.layout_b == "col"


def is_padded(choice: Choice) -> bool:
    return choice.template.startswith(("triton_padded", "padded_"))


# A tiled kernel reading an operand whose rows do not start 16-byte aligned loads it in narrow pieces. H100 datasets:
# with both operands misaligned the best unpadded Triton tile ran 2.4x (int8 1500^3) and 2.5x (int8 2047^3) the
# padded choice, copies included, and bf16 2047^3 at 146 us is ~5x an aligned 2048^3 product; with one, int8
# 1000x3000x2000 ran 1.16x the padded choice.
MISALIGNED_OPERAND_FACTOR = 2.0


def misaligned_operands(problem: GemmProblem) -> int:
    """How many operands have a pointer or leading dimension off 16 bytes."""
    return sum(not (align >= 16 and problem.leading_dim_aligned(which))
               for which, align in (("a", problem.align_a), ("b", problem.align_b)))


class AnalyticModel:
    name = "analytic"

    def predict(self, problem: GemmProblem, choices: Sequence[Choice]) -> list[float | None]:
        spec = gpu_spec(problem.arch, problem.device_name)
        misaligned_factor = MISALIGNED_OPERAND_FACTOR ** misaligned_operands(problem)
        out: list[float | None] = []
        for choice in choices:
            if choice.backend == "aten":
                out.append(library_ms(problem, spec))
                continue
            tile = tile_of(problem, choice)
            if tile is None:
                out.append(None)
                continue
            if tile.wgmma and not int8_wgmma(problem, choice):
                tile = dataclasses.replace(tile, wgmma=False)
            ms = estimate_of(problem, tile).ms
            if is_padded(choice):
                ms += pad_copy_ms(problem, spec)
            else:
                ms *= misaligned_factor
            out.append(ms)
        return out


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
    from kernels.space import perf_learned
    from kernels.core.config import config

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
