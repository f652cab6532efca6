"""triton_mm / triton_int8_mm / triton_scaled_mm: one tiled kernel, one program per output tile (templates/triton/mm.py.jinja)."""
from __future__ import annotations

from backends.triton_launch import kernel_sequence
from backends.triton_render import (
    dot_vars,
    epilogue_vars,
    even_k,
    gemm_args,
    layout_vars,
    ldc_multiple,
    make_spec,
)
from backends.triton_templates import TritonFamily
from kernels.core.choice import Choice
from kernels.core.problem import DTYPES_BY_NAME
from kernels.space.heuristics import candidate_configs, output_tiles


class MatmulFamily(TritonFamily):
    templates = ("triton_mm", "triton_int8_mm", "triton_scaled_mm")

    def choices(self, problem, template, space):
        return [Choice("triton", template, problem.dtype, cfg) for cfg in candidate_configs(problem, template, space)], {}

    def specs(self, problem, choice):
        cfg = choice.config
        return [make_spec("mm.py.jinja", choice.name, gemm_args(problem), cfg.num_warps, cfg.num_stages,
                          block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, group_m=cfg.group_m,
                          even_k=even_k(problem, cfg.block_k), store_n="N", **layout_vars(problem),
                          **dot_vars(problem), **epilogue_vars(problem))]

    def launcher(self, problem, choice, specs, handles):
        cfg = choice.config
        m, n, k = problem.m, problem.n, problem.k
        sa0, sa1 = problem.stride_a
        sb0, sb1 = problem.stride_b

        def args(a, b, out, ldc, bufs, epi):
            return ((a, b, out, *epi, m, n, k, sa0, sa1, sb0, sb1, ldc, 1),)

        return kernel_sequence(handles, [(output_tiles(problem, cfg), 1, 1)], args, (m, n),
                               DTYPES_BY_NAME[problem.out_dtype], ldc_multiple(specs[0]),
                               bias=problem.bias, scaling=problem.scaling)


FAMILY = MatmulFamily()
