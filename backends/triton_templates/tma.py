"""triton_tma_mm / triton_tma_int8_mm / triton_tma_scaled_mm: persistent kernel over tensor descriptors built on the device
(templates/triton/tma_persistent.py.jinja). sm90+ (and the interpreter): TMA needs 16-byte aligned bases and
row strides, and a unit stride in the last dimension of every operand."""
from __future__ import annotations

import functools

import torch

from backends.triton_launch import kernel_sequence
from backends.triton_render import (
    epilogue_args,
    dot_vars,
    epilogue_vars,
    int_arg,
    ldc_multiple,
    make_spec,
    ptr,
)
from backends.triton_templates import TritonFamily
from kernels.core.choice import Choice
from kernels.core.problem import DTYPE_BYTES, DTYPES_BY_NAME, GemmProblem
from kernels.space.families import TEMPLATE_CONFIG_LISTS
from kernels.space.heuristics import (
    candidate_configs,
    config_list,
    output_tiles,
    scale_config,
    shared_memory_limit,
    supports,
)

SUBTILE_MIN_TILE = 128 * 256      # tiles at least this large also get an epilogue-subtiled variant
INTERPRETER_PROGRAMS = 3          # few programs on CPU, so the persistent loop runs more than once


def tma_unsupported(problem: GemmProblem) -> str:
    """'' when descriptors can describe every operand of the problem, else why not."""
    if problem.device == "cuda" and problem.arch < 90:
        return f"TMA needs sm90+, device is sm{problem.arch}"
    if problem.layout_a == "strided" or problem.layout_b == "strided":
        return "TMA needs a unit stride in one dimension of each operand"
    if problem.align_a < 16 or problem.align_b < 16:
        return "TMA needs 16-byte aligned operand pointers"
    if not (problem.leading_dim_aligned("a") and problem.leading_dim_aligned("b")):
        return "TMA needs 16-byte aligned leading dimensions"
    if problem.rows_overlap("a") or problem.rows_overlap("b"):
        return "TMA needs operands whose rows do not overlap (a broadcast or overlapping view)"
    if (problem.n * problem.out_bytes) % 16:
        return "TMA needs 16-byte aligned output rows (N * element size % 16)"
    return ""


def epilogue_bytes(problem: GemmProblem, cfg, subtile: bool) -> int:
    return problem.out_bytes * cfg.block_m * cfg.block_n // (2 if subtile else 1)


class TmaFamily(TritonFamily):
    templates = ("triton_tma_mm", "triton_tma_int8_mm", "triton_tma_scaled_mm")

    def choices(self, problem, template, space):
        why = tma_unsupported(problem)
        if why:
            return [], {template: why}
        result = [Choice("triton", template, problem.dtype, cfg, (("sub", 1),) if subtile else ())
                  for cfg, subtile in tma_configs(problem, template, space)]
        return result, ({} if result else {template: "no persistent config fits shared memory"})

    def specs(self, problem, choice):
        cfg = choice.config
        lead_a, lead_b = problem.leading_dim("a"), problem.leading_dim("b")
        args = [ptr("a_ptr", problem.dtype), ptr("b_ptr", problem.b_dtype), ptr("c_ptr", problem.out_dtype),
                *epilogue_args(problem), int_arg(problem, "M", problem.m, "m"), int_arg(problem, "N", problem.n, "n"),
                int_arg(problem, "K", problem.k, "k"), int_arg(problem, "stride_a", lead_a),
                int_arg(problem, "stride_b", lead_b), int_arg(problem, "stride_cm", problem.n, "n")]
        dv = dot_vars(problem)
        return [make_spec("tma_persistent.py.jinja", choice.name, args, cfg.num_warps, cfg.num_stages,
                          block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, group_m=cfg.group_m,
                          subtile=bool(dict(choice.params).get("sub")), a_layout=problem.layout_a,
                          b_layout=problem.layout_b, flatten=False, ws_arg="", c_store="tma", **dv,
                          **epilogue_vars(problem))]

    def launcher(self, problem, choice, specs, handles):
        cfg = choice.config
        m, n, k = problem.m, problem.n, problem.k
        lead_a, lead_b = problem.leading_dim("a"), problem.leading_dim("b")
        device = handles[0].device
        programs = persistent_programs(problem, cfg, device)

        def args(a, b, out, ldc, bufs, epi):
            return ((a, b, out, *epi, m, n, k, lead_a, lead_b, ldc),)

        return kernel_sequence(handles, [(programs, 1, 1)], args, (m, n), DTYPES_BY_NAME[problem.out_dtype],
                               ldc_multiple(specs[0], 16, problem.out_bytes), bias=problem.bias,
                               scaling=problem.scaling)


def tma_configs(problem: GemmProblem, template: str, space: str) -> list[tuple]:
    """(config, epilogue subtiled) pairs of the persistent kernel that fit shared memory, from the persistent list
    (default space) or the exhaustive grid; never num_warps 2 with TMA."""
    limit = shared_memory_limit(problem.arch)
    configs = candidate_configs(problem, template, space) if space != "default" else _persistent(problem, template)
    pairs = []
    for cfg in configs:
        if cfg.num_warps < 4:
            continue
        pipeline = DTYPE_BYTES[problem.dtype] * (cfg.block_m + cfg.block_n) * cfg.block_k * cfg.num_stages
        for subtile in ((False, True) if cfg.block_m * cfg.block_n >= SUBTILE_MIN_TILE else (False,)):
            if pipeline + epilogue_bytes(problem, cfg, subtile) <= limit:
                pairs.append((cfg, subtile))
    return pairs


def persistent_programs(problem: GemmProblem, cfg, device: torch.device) -> int:
    """One program per SM (a few in the interpreter, so the persistent loop runs more than once), at most one per
    output tile."""
    return min(output_tiles(problem, cfg), _num_sms(device.index) if device.type == "cuda" else INTERPRETER_PROGRAMS)


def _persistent(problem, template):
    seen, result = set(), []
    for base in config_list(TEMPLATE_CONFIG_LISTS[template]):
        cfg = scale_config(base, problem)
        if cfg not in seen and supports(problem, template, cfg)[0]:
            seen.add(cfg)
            result.append(cfg)
    return result


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


FAMILY = TmaFamily()
