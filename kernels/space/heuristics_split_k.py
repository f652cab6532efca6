"""Which split counts to try for the split-K templates (split_k: one launch; decompose_k: bmm + reduce).

Splitting K pays when the output has too few tiles to fill the GPU: the splits multiply the programs in flight.
"""
from __future__ import annotations

from kernels.core.problem import GemmProblem
from kernels.space.heuristics import (
    DEFAULT_NUM_SMS,
    INT32_MAX,
    GemmConfig,
    cdiv,
    config_list,
    next_pow2,
    output_tiles,
    scale_config,
    supports,
)

MAX_WORKSPACE_ELEMENTS = 1 << 24          # fp32/int32 partials: 64 MiB at most
WAVE_TARGETS = (1, 2, 4)                  # aim tiles * split at this many waves of programs


def k_per_split(k: int, split: int, block_k: int) -> int:
    """K-range of one split: a whole number of blocks, so only the last split can end on a partial block."""
    return cdiv(cdiv(k, split), block_k) * block_k


def split_k_choices(problem: GemmProblem, space: str = "default",
                    num_sms: int = DEFAULT_NUM_SMS) -> tuple[list[tuple[GemmConfig, int]], str]:
    """(tile config, split) pairs for split_k, or ([], why not)."""
    if problem.m * problem.n > MAX_WORKSPACE_ELEMENTS:
        return [], f"output has more than {MAX_WORKSPACE_ELEMENTS} elements (workspace bound)"
    seen, pairs = set(), []
    for base in config_list("split_k_configs"):
        cfg = scale_config(base, problem)
        if cfg in seen or not supports(problem, "split_k", cfg)[0]:
            continue
        seen.add(cfg)
        n_tiles = output_tiles(problem, cfg)
        if n_tiles >= 2 * num_sms:
            continue                      # enough tiles to fill the GPU without splitting
        k_blocks = cdiv(problem.k, cfg.block_k)
        targets = WAVE_TARGETS if space == "default" else (1, 2, 4, 8)
        splits = {min(next_pow2(cdiv(w * num_sms, n_tiles)), k_blocks) for w in targets}
        # a split whose K-range would leave later splits empty is the same work as a smaller one
        splits = {s for s in splits if s >= 2 and cdiv(k_blocks, s) * (s - 1) < k_blocks}
        pairs.extend((cfg, s) for s in sorted(splits))
    if not pairs:
        return [], "output tiles already fill the GPU, or K too short to split"
    return pairs, ""


def decompose_k_splits(problem: GemmProblem, num_sms: int = DEFAULT_NUM_SMS, limit: int = 3) -> tuple[list[int], str]:
    """Splits for decompose_k (Inductor's rule: K >= 32 M and K >= 32 N; splits divide K into parts >= 128,
    powers of two first), the ones nearest a full wave of programs kept."""
    if "k" in problem.dynamic:
        return [], "K is dynamic: decompose_k needs splits that divide K"
    m, n, k = problem.m, problem.n, problem.k
    if k < 32 * m or k < 32 * n:
        return [], "K < 32*M or K < 32*N"
    divisors = [s for s in range(2, k // 128 + 1) if k % s == 0 and k // s >= 128]
    if not divisors:
        return [], "no split of K into equal parts >= 128"
    if max(divisors) * m * n > INT32_MAX:
        divisors = [s for s in divisors if s * m * n <= INT32_MAX]
    cfg = decompose_k_tile(problem, divisors[0])
    n_tiles = output_tiles(problem, cfg)
    pow2 = [s for s in divisors if s & (s - 1) == 0]
    pool = pow2 or divisors
    ranked = sorted(pool, key=lambda s: abs((n_tiles * s) / num_sms - 1.5))
    return sorted(ranked[:limit]), ""


def decompose_k_tile(problem: GemmProblem, split: int) -> GemmConfig:
    """decompose_k's only parameter is the split; its tile follows from the problem."""
    part = problem.k // split
    min_k = 32 if problem.dtype == "int8" else 16
    block_k = 128
    while block_k > min_k and part % block_k:      # a block that divides the part needs no K masks
        block_k //= 2
    if part % block_k:
        block_k = max(min(128, next_pow2(part)), min_k)
    return GemmConfig(block_m=min(max(next_pow2(problem.m), 16), 64), block_n=min(max(next_pow2(problem.n), 16), 64),
                      block_k=block_k, num_stages=4, num_warps=4, group_m=8)
