"""triton_kmajor_int8_mm: int8 with B not K-major, in two launches. A transpose kernel copies B into a K-major
buffer (rows 16-byte aligned), then triton_int8_mm reads that. Hopper's int8 wgmma takes B from shared memory only
K-major; given N-major B, Triton transposes each tile in registers inside the main loop (PRMT in the SASS), and on
the H200 that ran 3.6x slower than the same kernel on a K-major B (4096^3: 493 vs 137 us), far more than one extra
pass over B costs. cuBLAS's torch._int_mm shows the same cliff (1085 vs 160 us)."""
from __future__ import annotations

import dataclasses

import torch

from backends.padded import is_aligned
from backends.triton_launch import kernel_sequence, per_stream
from backends.triton_render import (
    dot_vars,
    epilogue_vars,
    even_k,
    gemm_args,
    int_arg,
    layout_vars,
    ldc_multiple,
    make_spec,
    ptr,
)
from backends.triton_templates import TritonFamily
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.heuristics import candidate_configs, cdiv, output_tiles, round_up

TRANSPOSE_BLOCK = (128, 128)    # K x N elements one transpose program moves: 128-byte rows both ways for int8
# Skinny problems are bound by reading B, and a transpose reads and writes B once more; still, on the H200 the
# N-major int8 path read B at only 0.7-1.1 TB/s at M=64 (llama shapes) against 1.8-3.9 TB/s with B K-major, so
# the copy can pay there. Below M=16 (unmeasured) the default path is left alone.
MIN_M = 16


def kmajor_ld(problem: GemmProblem) -> int:
    """Row length of the K-major copy: K rounded up to 16 elements (16 bytes for int8), so every row is aligned."""
    return round_up(problem.k, 16)


def inner_problem(problem: GemmProblem) -> GemmProblem:
    """What the mm sees: the caller's A and a K-major B with aligned rows."""
    return dataclasses.replace(problem, stride_b=(1, kmajor_ld(problem)), align_b=16)


class KMajorTritonFamily(TritonFamily):
    templates = ("triton_kmajor_int8_mm",)

    def choices(self, problem, template, space):
        if problem.layout_b == "col":
            return [], {template: "B is already K-major"}
        if problem.m < MIN_M:
            return [], {template: f"M={problem.m} < {MIN_M}: too short a product to pay for copying B"}
        if not is_aligned(problem):
            return [], {template: "misaligned operands: triton_padded_int8_mm copies B K-major itself"}
        # triton_int8_mm's own list for a K-major B: the mm is most of the time, so its tile choice matters as much
        configs = candidate_configs(inner_problem(problem), "triton_int8_mm", space)
        return [Choice("triton", template, problem.dtype, cfg) for cfg in configs], {}

    def specs(self, problem, choice):
        cfg = choice.config
        inner = inner_problem(problem)
        t_args = [ptr("b_ptr", problem.dtype, problem.align_b >= 16), ptr("bt_ptr", problem.dtype),
                  int_arg(problem, "K", problem.k, "k"), int_arg(problem, "N", problem.n, "n"),
                  int_arg(problem, "ldbt", kmajor_ld(problem), "k"), int_arg(problem, "stride_bk", problem.stride_b[0]),
                  int_arg(problem, "stride_bn", problem.stride_b[1])]
        transpose = make_spec("transpose_b.py.jinja", choice.name + "_bt", t_args, 4, 1, block_k=TRANSPOSE_BLOCK[0],
                              block_n=TRANSPOSE_BLOCK[1], **layout_vars(problem))
        mm = make_spec("mm.py.jinja", choice.name, gemm_args(inner), cfg.num_warps, cfg.num_stages,
                       block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, group_m=cfg.group_m,
                       even_k=even_k(inner, cfg.block_k), store_n="N", **layout_vars(inner), **dot_vars(inner),
                       **epilogue_vars(inner))
        return [transpose, mm]

    def launcher(self, problem, choice, specs, handles):
        cfg = choice.config
        m, n, k = problem.m, problem.n, problem.k
        ld = kmajor_ld(problem)
        sa0, sa1 = problem.stride_a
        sb0, sb1 = problem.stride_b
        grids = [(cdiv(k, TRANSPOSE_BLOCK[0]) * cdiv(n, TRANSPOSE_BLOCK[1]), 1, 1), (output_tiles(problem, cfg), 1, 1)]
        device = handles[0].device
        # every call rewrites the whole N x K region the mm reads, so one buffer per stream is reused
        scratch = per_stream(device, lambda: torch.empty(n * ld, dtype=torch.int8, device=device))

        def args(a, b, out, ldc, bt, epi):     # int8: never an epilogue
            return (b, bt, k, n, ld, sb0, sb1), (a, bt, out, m, n, k, sa0, sa1, 1, ld, ldc, 1)

        return kernel_sequence(handles, grids, args, (m, n), torch.int32, ldc_multiple(specs[1]), scratch)


FAMILY = KMajorTritonFamily()
