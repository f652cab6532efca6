"""split_k (one launch, atomic reduction into a self-cleaning workspace) and decompose_k (batched partial products,
then a deterministic reduce launch): templates/triton/split_k.py.jinja and reduce.py.jinja."""
from __future__ import annotations

import dataclasses

import torch

from backends.triton_launch import kernel_sequence, per_stream
from backends.triton_render import (
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
from kernels.core.choice import Choice
from kernels.core.problem import DTYPES_BY_NAME
from kernels.space.heuristics import cdiv, output_tiles
from kernels.space.heuristics_split_k import decompose_k_splits, decompose_k_tile, k_per_split, split_k_choices

REDUCE_BLOCK = 1024


def _acc_dtype(problem) -> str:
    return "int32" if problem.dtype == "int8" else "fp32"


def _partial_spec(problem, name, cfg, split, reduce, even, kps):
    """The split kernel; with reduce "atomic" it applies the problem's epilogue, so decompose_k hands it the
    problem without one (its reduce launch applies it)."""
    args = gemm_args(problem)
    pointers = 3 + len(epilogue_args(problem))        # a, b, c and the epilogue's tensors
    extra = [ptr("ws_ptr", _acc_dtype(problem))] + ([ptr("lock_ptr", "int32")] if reduce == "atomic" else [])
    # the split's K offset moves the operand pointers: assume 16-divisibility only when it holds
    args = args[:pointers] + extra + args[pointers:] + [int_arg(problem, "k_per_split", kps, "k")]
    return make_spec("split_k.py.jinja", name, args, cfg.num_warps, cfg.num_stages, block_m=cfg.block_m,
                     block_n=cfg.block_n, block_k=cfg.block_k, group_m=cfg.group_m, even_k=even,
                     split=split, reduce=reduce, **layout_vars(problem), **dot_vars(problem),
                     **epilogue_vars(problem))


def without_epilogue(problem):
    """The plain product: what decompose_k's partial products compute (and so share binaries with it)."""
    return dataclasses.replace(problem, bias=False, activation="")


class SplitKFamily(TritonFamily):
    templates = ("split_k",)

    def choices(self, problem, template, space):
        pairs, why = split_k_choices(problem, space)
        if not pairs:
            return [], {template: why}
        return [Choice("triton", template, problem.dtype, cfg, (("split", s),)) for cfg, s in pairs], {}

    def specs(self, problem, choice):
        # unmasked K only when every split covers whole blocks and none runs past K
        cfg, split = choice.config, dict(choice.params)["split"]
        k_blocks = cdiv(problem.k, cfg.block_k)
        if cdiv(k_blocks, split) * (split - 1) >= k_blocks:
            # the kernel assumes every split has a K-range (split_k_choices never makes one that does not); a stored
            # or pinned split past that computed garbage or faulted (split 4096 on K=16)
            raise ValueError(f"split {split} leaves splits with no K-range for K={problem.k}, block_k={cfg.block_k}")
        kps = k_per_split(problem.k, split, cfg.block_k)
        even = even_k(problem, cfg.block_k) and problem.k % kps == 0
        return [_partial_spec(problem, choice.name, cfg, split, "atomic", even, kps)]

    def launcher(self, problem, choice, specs, handles):
        cfg, split = choice.config, dict(choice.params)["split"]
        m, n, k = problem.m, problem.n, problem.k
        sa0, sa1 = problem.stride_a
        sb0, sb1 = problem.stride_b
        n_tiles, kps = output_tiles(problem, cfg), k_per_split(k, split, cfg.block_k)
        device = handles[0].device
        acc_dtype = DTYPES_BY_NAME[_acc_dtype(problem)]
        # zeroed once; every launch leaves them zero again
        workspace = per_stream(device, lambda: (torch.zeros(m * n, dtype=acc_dtype, device=device),
                                                torch.zeros(n_tiles, dtype=torch.int32, device=device)))

        def args(a, b, out, ldc, ws, epi):
            return ((a, b, out, *epi, ws[0], ws[1], m, n, k, sa0, sa1, sb0, sb1, ldc, 1, kps),)

        return kernel_sequence(handles, [(n_tiles, split, 1)], args, (m, n), DTYPES_BY_NAME[problem.out_dtype],
                               ldc_multiple(specs[0]), workspace, bias=problem.bias,
                               scaling=problem.scaling)


class DecomposeKFamily(TritonFamily):
    templates = ("decompose_k",)

    def choices(self, problem, template, space):
        splits, why = decompose_k_splits(problem)
        if not splits:
            return [], {template: why}
        return [Choice("triton", template, problem.dtype, None, (("split", s),)) for s in splits], {}

    def specs(self, problem, choice):
        split = dict(choice.params)["split"]
        if problem.k % split:       # the partial products cover K // split each: a remainder would be dropped
            raise ValueError(f"split {split} does not divide K={problem.k}")
        cfg = decompose_k_tile(problem, split)
        reduce_args = [ptr("ws_ptr", _acc_dtype(problem)), ptr("c_ptr", problem.out_dtype), *epilogue_args(problem),
                       int_arg(problem, "MN", problem.m * problem.n, "mn"), int_arg(problem, "N", problem.n, "n"),
                       int_arg(problem, "stride_cm", problem.n, "n")]
        reduce = make_spec("reduce.py.jinja", choice.name + "_reduce", reduce_args, 4, 1, block=REDUCE_BLOCK,
                           split=split, acc_type=dot_vars(problem)["acc_type"], **epilogue_vars(problem))
        even = even_k(problem, cfg.block_k) and (problem.k // split) % cfg.block_k == 0
        partials = _partial_spec(without_epilogue(problem), choice.name, cfg, split, "partials", even,
                                 problem.k // split)
        return [partials, reduce]

    def launcher(self, problem, choice, specs, handles):
        split = dict(choice.params)["split"]
        cfg = decompose_k_tile(problem, split)
        m, n, k = problem.m, problem.n, problem.k
        sa0, sa1 = problem.stride_a
        sb0, sb1 = problem.stride_b
        kps = k // split
        grids = [(output_tiles(problem, cfg), split, 1), (cdiv(m * n, REDUCE_BLOCK), 1, 1)]
        device = handles[0].device
        acc_dtype = DTYPES_BY_NAME[_acc_dtype(problem)]
        workspace = per_stream(device, lambda: torch.empty(split * m * n, dtype=acc_dtype, device=device))

        def args(a, b, out, ldc, ws, epi):
            return (a, b, out, ws, m, n, k, sa0, sa1, sb0, sb1, ldc, 1, kps), (ws, out, *epi, m * n, n, ldc)

        return kernel_sequence(handles, grids, args, (m, n), DTYPES_BY_NAME[problem.out_dtype],
                               ldc_multiple(specs[0]), workspace, bias=problem.bias,
                               scaling=problem.scaling)


SPLIT_K = SplitKFamily()
DECOMPOSE_K = DecomposeKFamily()
