"""Performance models: predict each candidate's time so a large search space can be cut to the best few.

One interface, `model.predict(problem, choices) -> list[float | None]` (milliseconds; None: the model cannot say),
two implementations:
- `AnalyticModel`: no data. Roofline (peak tensor FLOP/s, HBM bandwidth), wave quantization of the output tiles over
  the SMs (blocks per SM from shared memory, warps and registers), tile efficiency (shared-memory operand traffic per
  MMA, warpgroup MMA on sm90), pipeline depth (how much of the load latency the stages hide), launch latency.
  It ranks; its absolute times are rough.
- `LearnedModel` (kernels/perf_learned.py): a small MLP on features of the problem, the tile and the analytic
  prediction, trained on measured timings; valid only for the GPU and Triton version it was trained on.

Which model ranks a problem's candidates, and how the top k are drawn from its predictions: kernels/space/ranking.py.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.heuristics import cdiv
from kernels.space.heuristics_cutlass import CutlassConfig


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
