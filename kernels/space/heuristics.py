"""Config lists, scaling to a problem, and the one `supports()` check that pruning, choice generation and tests share.

The starting lists are PyTorch Inductor's (kernels/data/inductor_gemm_configs.json); measurement decides what stays.
"""
from __future__ import annotations

import functools
import itertools
import json
from importlib import resources

from kernels.core.choice import GemmConfig
from kernels.core.problem import DTYPE_BYTES, GemmProblem
from kernels.space.families import TEMPLATE_CONFIG_LISTS, TEMPLATE_OPS

# Largest dynamic shared memory one block may use, by compute capability (cudaDevAttrMaxSharedMemoryPerBlockOptin).
# Streaming multiprocessors of the devices we tune for (H100 SXM / H200: 132); used where a choice depends on waves.
DEFAULT_NUM_SMS = 132
SHARED_MEMORY_LIMIT = {90: 232_448, 100: 232_448, 89: 101_376, 86: 101_376, 80: 166_912, 75: 65_536}
DEFAULT_SHARED_MEMORY = 232_448          # cpu / interpreter: prune as for Hopper so lists match the GPU
MAX_ACC_REGISTERS = 255                  # accumulator elements per thread beyond this spill
INT32_MAX = 2**31 - 1


@functools.lru_cache(maxsize=1)
def _raw_lists() -> dict:
    """Inductor's lists (mm_configs, int8_mm_configs, persistent_mm_configs, ...) and ours (split_k_configs, ...)."""
    data = json.loads(resources.files("kernels").joinpath("data/inductor_gemm_configs.json").read_text())
    ours = json.loads(resources.files("kernels").joinpath("data/template_configs.json").read_text())
    clash = (set(data) & set(ours)) - {"notes"}
    if clash:
        raise ValueError(f"config lists defined twice: {sorted(clash)}")
    notes = {**data.pop("notes", {}), **ours.pop("notes", {})}
    return {**data, **ours, "notes": notes}


def config_list(names: str | tuple[str, ...]) -> list[GemmConfig]:
    """Named lists from the data files (mm_configs, int8_mm_configs, persistent_mm_configs, ...), concatenated."""
    return [GemmConfig.from_dict(c) for name in ((names,) if isinstance(names, str) else names)
            for c in _raw_lists()[name]]


def exhaustive_configs() -> list[GemmConfig]:
    space = _raw_lists()["exhaustive_space"]
    return [GemmConfig(*values) for values in itertools.product(
        space["block_m"], space["block_n"], space["block_k"], space["num_stages"], space["num_warps"],
        space["group_m"])]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(x: int, multiple: int) -> int:
    return cdiv(x, multiple) * multiple


def output_tiles(problem: GemmProblem, config: GemmConfig) -> int:
    """How many BLOCK_M x BLOCK_N tiles cover the output."""
    return cdiv(problem.m, config.block_m) * cdiv(problem.n, config.block_n)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def scale_config(config: GemmConfig, problem: GemmProblem) -> GemmConfig:
    """Clamp each block to the next power of two of its dimension (min 16; block_k min 32 for 8-bit inputs)."""
    min_k = 32 if problem.elem_bytes == 1 else 16
    return GemmConfig(
        block_m=max(min(config.block_m, next_pow2(problem.m)), 16),
        block_n=max(min(config.block_n, next_pow2(problem.n)), 16),
        block_k=max(min(config.block_k, next_pow2(problem.k)), min_k),
        num_stages=config.num_stages, num_warps=config.num_warps, group_m=config.group_m)


def shared_memory_bytes(config: GemmConfig, problem: GemmProblem) -> int:
    """Pipelined operand tiles: what the software pipeline keeps in shared memory."""
    return DTYPE_BYTES[problem.dtype] * (config.block_m + config.block_n) * config.block_k * config.num_stages


def shared_memory_limit(arch: int) -> int:
    return SHARED_MEMORY_LIMIT.get(arch, DEFAULT_SHARED_MEMORY)


def _max_offset(rows: int, cols: int, stride: tuple[int, int]) -> int:
    return (rows - 1) * abs(stride[0]) + (cols - 1) * abs(stride[1])


def supports(problem: GemmProblem, template: str, config: GemmConfig | None) -> tuple[bool, str]:
    """Can `template` with `config` run `problem`? The reason names the first rule that fails."""

    ops = TEMPLATE_OPS.get(template)
    if ops is None:
        return False, f"unknown template {template}"
    if problem.op not in ops:
        return False, f"{template} does not implement {problem.op}"
    if config is None:
        return True, ""
    if problem.dtype != "int8" and template.startswith("triton_int8"):
        return False, f"{template} needs int8 inputs"
    if min(config.block_m, config.block_n, config.block_k) < 16:
        return False, "tl.dot needs blocks of at least 16"
    if problem.elem_bytes == 1 and config.block_k < 32:
        return False, f"{problem.dtype} dot needs block_k >= 32"
    if problem.op == "scaled_mm" and (problem.layout_a != "row" or problem.layout_b != "col"):
        return False, "fp8 tensor cores read A and B K-major only (A row-major, B column-major)"
    smem = shared_memory_bytes(config, problem)
    limit = shared_memory_limit(problem.arch)
    if smem > limit:
        return False, f"shared memory {smem} B > {limit} B"
    if -(-config.block_m * config.block_n // (config.num_warps * 32)) > MAX_ACC_REGISTERS:
        return False, f"accumulator needs > {MAX_ACC_REGISTERS} registers per thread"
    worst = max(_max_offset(problem.m, problem.k, problem.stride_a), _max_offset(problem.k, problem.n, problem.stride_b),
                problem.m * problem.n)
    if worst > INT32_MAX:
        return False, "offsets exceed 32-bit indexing"
    return True, ""


# Hopper's exhaustive space leaves out num_stages=1 (no software pipelining). In the H100/H200 datasets (126
# problems, 1427 timed stage-1 candidates) that cost one problem 4.4% (int8 3000x2000x1000, where padding runs 2x
# faster), and the learned model's worst extrapolations were stage-1 tiles (the fast preset on the H100 timed
# triton_tma_int8_mm 256x64x256 s1 at 86.7 us for 4000x4000x320 int8, where 38.5 us was measured).
MIN_EXHAUSTIVE_STAGES_SM90 = 2


def candidate_configs(problem: GemmProblem, template: str, space: str = "default") -> list[GemmConfig]:
    """The template's configs scaled to the problem, unsupported ones dropped, duplicates removed, order kept."""

    if space == "exhaustive":
        base = exhaustive_configs()
        if problem.arch >= 90:          # the default list's own configs stay: exhaustive covers default
            listed = set(config_list(TEMPLATE_CONFIG_LISTS[template]))
            base = [c for c in base if c.num_stages >= MIN_EXHAUSTIVE_STAGES_SM90 or c in listed]
    else:
        base = config_list(TEMPLATE_CONFIG_LISTS[template])
    seen: set[GemmConfig] = set()
    result = []
    for cfg in base:
        scaled = scale_config(cfg, problem)
        if scaled in seen:
            continue
        seen.add(scaled)
        if supports(problem, template, scaled)[0]:
            result.append(scaled)
    return result
