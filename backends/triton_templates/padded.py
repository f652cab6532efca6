"""triton_padded_mm / triton_padded_int8_mm: a misaligned problem in two launches. One kernel copies both operands
into zero-padded buffers (K and N rounded up to 16 elements, so every load of the product vectorizes; int8 B
K-major); the tiled mm then reads those and writes the caller's N-wide output directly. The `padded` backend does
the same with torch ops (four launches); on a host-bound GPU the launches are what the call costs.

triton_padded_tma_mm / triton_padded_tma_int8_mm (sm90+): the same copy, then the persistent TMA kernel reads the
aligned buffers through tensor descriptors and stores the caller's rows through pointers (TMA cannot address them)."""
from __future__ import annotations

import dataclasses

import torch

from backends.padded import fills_first, hopper_wave_tiles, inner_triton_configs, is_aligned
from backends.triton_launch import kernel_sequence, per_stream
from backends.triton_render import (
    Arg,
    epilogue_args,
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
from backends.triton_templates.tma import persistent_programs, tma_configs, tma_unsupported
from kernels.core.choice import Choice
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.space.heuristics import cdiv, round_up

INNER_TEMPLATE = {"triton_padded_mm": "triton_mm", "triton_padded_int8_mm": "triton_int8_mm",
                  "triton_padded_tma_mm": "triton_tma_mm", "triton_padded_tma_int8_mm": "triton_tma_int8_mm"}


def padded_shape(problem: GemmProblem) -> tuple[int, int]:
    """(Kp, Np): K and N rounded up to 16 elements (the divisibility Triton vectorizes masked loads on)."""
    return round_up(problem.k, 16), round_up(problem.n, 16)


def b_kmajor(problem: GemmProblem) -> bool:
    """int8 B is copied K-major: Hopper's int8 wgmma reads only K-major B (see backends/triton_templates/kmajor.py)."""
    return problem.dtype == "int8"


def pad_block(problem: GemmProblem) -> tuple[int, int]:
    """rows x columns one copy program moves; a K-major B copy stores BLOCK_R-long runs, so int8 takes 128."""
    return (128, 128) if b_kmajor(problem) else (32, 128)


def inner_problem(problem: GemmProblem) -> GemmProblem:
    kp, np_ = padded_shape(problem)
    stride_b = (1, kp) if b_kmajor(problem) else (np_, 1)
    return dataclasses.replace(problem, k=kp, n=np_, stride_a=(kp, 1), stride_b=stride_b, align_a=16, align_b=16)


class PaddedTritonFamily(TritonFamily):
    templates = ("triton_padded_mm", "triton_padded_int8_mm")

    def choices(self, problem, template, space):
        if is_aligned(problem):
            return [], {template: "operands are already 16-byte aligned"}
        configs = inner_triton_configs(inner_problem(problem), INNER_TEMPLATE[template], space)
        return [Choice("triton", template, problem.dtype, cfg) for cfg in configs], {}

    def specs(self, problem, choice):
        cfg = choice.config
        inner = inner_problem(problem)
        # B is Np wide, the caller's output (and the bias) N wide
        mm_args = gemm_args(inner, out_cols=problem.n) + [int_arg(problem, "N_OUT", problem.n, "n")]
        mm = make_spec("mm.py.jinja", choice.name, mm_args, cfg.num_warps, cfg.num_stages, block_m=cfg.block_m,
                       block_n=cfg.block_n, block_k=cfg.block_k, group_m=cfg.group_m, even_k=even_k(inner, cfg.block_k),
                       store_n="N_OUT", **layout_vars(inner), **dot_vars(inner), **epilogue_vars(problem))
        return [pad_spec(problem), mm]

    def launcher(self, problem, choice, specs, handles):
        cfg = choice.config
        m, n = problem.m, problem.n
        kp, np_ = padded_shape(problem)
        sbp0, sbp1 = inner_problem(problem).stride_b
        pad_grid, pad_args, buffers = pad_launch(problem, handles[0].device)
        grids = [pad_grid, (cdiv(m, cfg.block_m) * cdiv(np_, cfg.block_n), 1, 1)]

        def args(a, b, out, ldc, bufs, epi):
            ap, bp = bufs
            return pad_args(a, b, bufs), (ap, bp, out, *epi, m, np_, kp, kp, 1, sbp0, sbp1, ldc, 1, n)

        return kernel_sequence(handles, grids, args, (m, n), DTYPES_BY_NAME[problem.out_dtype],
                               ldc_multiple(specs[1]), buffers, bias=problem.bias)


class PaddedTmaFamily(TritonFamily):
    templates = ("triton_padded_tma_mm", "triton_padded_tma_int8_mm")

    def choices(self, problem, template, space):
        if is_aligned(problem):
            return [], {template: "operands are already 16-byte aligned"}
        inner = inner_problem(problem)
        why = tma_unsupported(inner)
        if why:
            return [], {template: why}
        # chosen as for the tiled inner, in every search space (the exhaustive grid would add ~700 choices of a
        # template no learned model has timed)
        fitting = [cfg for cfg, subtile in tma_configs(inner, INNER_TEMPLATE[template], space) if not subtile]
        chosen = fills_first(inner, fitting)
        configs = chosen + hopper_wave_tiles(inner, fitting, chosen)
        result = [Choice("triton", template, problem.dtype, cfg) for cfg in configs]
        return result, ({} if result else {template: "no persistent config fits shared memory"})

    def specs(self, problem, choice):
        cfg = choice.config
        inner = inner_problem(problem)
        lead_a, lead_b = inner.leading_dim("a"), inner.leading_dim("b")
        args = [ptr("a_ptr", problem.dtype), ptr("b_ptr", problem.dtype), ptr("c_ptr", problem.out_dtype),
                *epilogue_args(problem), int_arg(problem, "M", inner.m, "m"), int_arg(problem, "N", inner.n, "n"),
                int_arg(problem, "K", inner.k, "k"), int_arg(problem, "stride_a", lead_a, "k"),
                int_arg(problem, "stride_b", lead_b, "kn"), int_arg(problem, "stride_cm", problem.n, "n"),
                int_arg(problem, "N_OUT", problem.n, "n")]
        mm = make_spec("tma_persistent.py.jinja", choice.name, args, cfg.num_warps, cfg.num_stages,
                       block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, group_m=cfg.group_m,
                       subtile=False, a_layout=inner.layout_a, b_layout=inner.layout_b, flatten=False, ws_arg="",
                       c_store="pointer", **dot_vars(inner), **epilogue_vars(problem))
        return [pad_spec(problem), mm]

    def launcher(self, problem, choice, specs, handles):
        m, n = problem.m, problem.n
        inner = inner_problem(problem)
        lead_a, lead_b = inner.leading_dim("a"), inner.leading_dim("b")
        device = handles[0].device
        pad_grid, pad_args, buffers = pad_launch(problem, device)
        grids = [pad_grid, (persistent_programs(inner, choice.config, device), 1, 1)]

        def args(a, b, out, ldc, bufs, epi):
            ap, bp = bufs
            return pad_args(a, b, bufs), (ap, bp, out, *epi, m, inner.n, inner.k, lead_a, lead_b, ldc, n)

        return kernel_sequence(handles, grids, args, (m, n), DTYPES_BY_NAME[problem.out_dtype],
                               ldc_multiple(specs[1]), buffers, bias=problem.bias)


def pad_spec(problem: GemmProblem):
    """The copy kernel: both operands into the zero-padded buffers, in one launch. Named by what it copies, not by
    the choice: every padded choice of a problem shares one binary (one compile, and a sibling's copy is built)."""
    kp, np_ = padded_shape(problem)
    sa, sb = problem.stride_a, problem.stride_b
    pad_args = [ptr("a_ptr", problem.dtype, problem.align_a >= 16), ptr("b_ptr", problem.dtype, problem.align_b >= 16),
                ptr("ap_ptr", problem.dtype), ptr("bp_ptr", problem.dtype),
                int_arg(problem, "M", problem.m, "m"), int_arg(problem, "N", problem.n, "n"),
                int_arg(problem, "K", problem.k, "k"), int_arg(problem, "Kp", kp, "k"),
                int_arg(problem, "Np", np_, "n"), int_arg(problem, "stride_am", sa[0]),
                int_arg(problem, "stride_ak", sa[1]), int_arg(problem, "stride_bk", sb[0]),
                int_arg(problem, "stride_bn", sb[1]), Arg("a_programs", "i32", False)]
    block_r, block_c = pad_block(problem)
    name = f"padded_copy_{problem.dtype}_{problem.layout_a}_{problem.layout_b}{'_kmajor' if b_kmajor(problem) else ''}"
    return make_spec("pad2.py.jinja", name + "_pad", pad_args, 4, 1, block_r=block_r, block_c=block_c,
                     b_kmajor=b_kmajor(problem), **layout_vars(problem))


def pad_launch(problem: GemmProblem, device: torch.device):
    """(the copy kernel's grid, args(a, b, bufs) -> its argument tuple, the current stream's padded buffers)."""
    m, n, k = problem.m, problem.n, problem.k
    kp, np_ = padded_shape(problem)
    sa0, sa1 = problem.stride_a
    sb0, sb1 = problem.stride_b
    block_r, block_c = pad_block(problem)
    a_programs = cdiv(m, block_r) * cdiv(kp, block_c)
    b_programs = cdiv(kp, block_r) * cdiv(np_, block_c)
    dtype = DTYPES_BY_NAME[problem.dtype]
    # the padded copies are rewritten whole by every call (zeros included), so one pair per stream is reused
    buffers = per_stream(device, lambda: (torch.empty(m * kp, dtype=dtype, device=device),
                                          torch.empty(kp * np_, dtype=dtype, device=device)))

    def args(a, b, bufs):
        ap, bp = bufs
        return (a, b, ap, bp, m, n, k, kp, np_, sa0, sa1, sb0, sb1, a_programs)

    return (a_programs + b_programs, 1, 1), args, buffers


FAMILY = PaddedTritonFamily()
TMA_FAMILY = PaddedTmaFamily()
