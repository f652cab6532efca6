"""padded: for problems whose operands are not 16-byte aligned (leading dimension or pointer), copy them into
zero-padded row-major buffers with aligned strides and run an aligned choice (aten or a Triton template) on those.
The copies are part of every call, so they are part of the timing: the tuner keeps padding only where it pays
(torch.mm runs 2047^3 bf16 at a fraction of its 2048^3 speed)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from backends import get_backend
from backends.base import Backend, BuildOutcome, Runner
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.families import backend_of
from kernels.space.heuristics import DEFAULT_NUM_SMS, candidate_configs, config_list, output_tiles, round_up, supports

INNER_TRITON_CONFIGS = 4      # aligned Triton configs tried behind the padding (aten is always tried)
# Hopper's largest wgmma tiles (128x256 and 256x128, from Inductor's persistent list; the mm lists have none) join
# where their tiles cover this share of the SMs: behind the padding of 2047^3 (2048^3 inside) 128 tiles on 132 SMs,
# where the 128x128 tiles that won on the H100 take two waves of 256 and ran the product at 390 TFLOP/s (44 us).
FULL_WAVE = 0.95
# int_mm has no aten inner choice: cuBLASLt's int8 path refuses the row-major padded B (CUBLAS_STATUS_NOT_SUPPORTED
# on the H200) and Triton's int8 kernel is twice as fast as torch._int_mm anyway
INNER_TEMPLATES = {"mm": ("aten_mm", "triton_mm"), "int_mm": (None, "triton_int8_mm")}


def is_aligned(problem: GemmProblem) -> bool:
    """Both operands have 16-byte aligned pointers and leading dimensions."""
    return (problem.align_a >= 16 and problem.align_b >= 16 and problem.leading_dim_aligned("a")
            and problem.leading_dim_aligned("b"))


def padded_dims(problem: GemmProblem) -> tuple[int, int]:
    """(K, N) rounded up so that row-major rows of A (length K) and of B (length N) start 16-byte aligned."""
    elems = 16 // problem.elem_bytes
    return round_up(problem.k, elems), round_up(problem.n, elems)


def inner_problem(problem: GemmProblem) -> GemmProblem:
    """What the inner choice sees: A is M x Kp and B is Kp x Np, both row-major with aligned rows. The inner
    choice computes all Np columns: an N that is not a multiple of the vector width would cost it vectorized B loads
    (Triton) or its fast kernels (cuBLAS, for an unaligned output); the first N columns are kept."""
    kp, np_ = padded_dims(problem)
    return dataclasses.replace(problem, k=kp, n=np_, stride_a=(kp, 1), stride_b=(np_, 1), align_a=16, align_b=16)


def _inner_choice(choice: Choice) -> Choice:
    template = choice.template[len("padded_"):]
    return Choice(backend_of(template), template, choice.dtype, choice.config, choice.params)


def inner_triton_configs(inner: GemmProblem, template: str, space: str) -> list:
    """The few aligned Triton configs tried behind padding (here and in the Triton padded family): fills_first, then
    on Hopper the persistent list's largest tiles where they fill a wave (hopper_wave_tiles)."""
    configs = fills_first(inner, candidate_configs(inner, template, space))
    wave = hopper_wave_tiles(inner, config_list("persistent_mm_configs"), configs)
    return configs + [c for c in wave if supports(inner, template, c)[0]]


def fills_first(inner: GemmProblem, configs: list) -> list:
    """The INNER_TRITON_CONFIGS of `configs` tried behind padding: a full wave of tiles first, then the largest
    tiles, then the deepest pipeline and the most warps."""
    def score(cfg) -> tuple:
        return (output_tiles(inner, cfg) >= DEFAULT_NUM_SMS, cfg.block_m * cfg.block_n, cfg.num_stages,
                cfg.num_warps)

    return sorted(configs, key=score, reverse=True)[:INNER_TRITON_CONFIGS]


def hopper_wave_tiles(inner: GemmProblem, configs: list, chosen: list) -> list:
    """On sm90+, the persistent list's 128x256 / 256x128 configs among `configs`, not in `chosen`, whose tiles
    cover FULL_WAVE of the SMs."""
    if inner.arch < 90:
        return []
    persistent = set(config_list("persistent_mm_configs"))
    return [c for c in configs if c in persistent and c.block_m * c.block_n >= 128 * 256 and c not in chosen
            and output_tiles(inner, c) >= FULL_WAVE * DEFAULT_NUM_SMS]


class PaddedBackend(Backend):
    name = "padded"

    def available(self, problem: GemmProblem) -> tuple[bool, str]:
        if problem.op not in INNER_TEMPLATES:
            return False, f"no padded template for {problem.op}"
        if is_aligned(problem):
            return False, "operands are already 16-byte aligned"
        return True, ""

    def choices(self, problem, space="default"):
        aten, triton_template = INNER_TEMPLATES[problem.op]
        inner = inner_problem(problem)
        result = [Choice("padded", "padded_" + aten, problem.dtype)] if aten else []
        triton_ok, why = get_backend("triton").available(inner)
        if triton_ok:
            configs = inner_triton_configs(inner, triton_template, space)
            result += [Choice("padded", "padded_" + triton_template, problem.dtype, cfg) for cfg in configs]
        skipped = {} if triton_ok else {"padded_" + triton_template: f"triton unavailable: {why}"}
        return result, skipped

    def build(self, problem, choices):
        outcomes = []
        inner = inner_problem(problem)
        groups: dict[str, list[tuple[Choice, Choice]]] = {}
        for choice in choices:
            inner_choice = _inner_choice(choice)
            groups.setdefault(inner_choice.backend, []).append((choice, inner_choice))
        for backend_name, pairs in groups.items():
            try:
                built = get_backend(backend_name).build(inner, [ic for _, ic in pairs])
            except Exception as e:  # noqa: BLE001
                outcomes += [BuildOutcome(c, None, f"inner build failed: {type(e).__name__}: {e}") for c, _ in pairs]
                continue
            for (choice, _), res in zip(pairs, built):
                if res.runner is None:
                    outcomes.append(BuildOutcome(choice, None, f"inner {res.choice.name}: {res.error}",
                                                 compiled=res.compiled))
                    continue
                launch = _padded_launch(problem, res.runner.launch)
                # a padded Triton choice runs a Triton kernel: isolated when its inner runner is
                outcomes.append(BuildOutcome(choice, Runner(choice, launch, isolated=res.runner.isolated),
                                             compiled=res.compiled, seconds=res.seconds))
        order = {c.name: i for i, c in enumerate(choices)}
        return sorted(outcomes, key=lambda o: order[o.choice.name])


def _padded_launch(problem: GemmProblem, inner_launch):
    """launch(a, b, out): copy each operand that is not already in the inner layout into a zero-padded aligned
    buffer (one kernel each), run the inner choice on all Np columns, keep the first N."""
    kp, np_ = padded_dims(problem)
    n, pad_k, pad_n = problem.n, kp - problem.k, np_ - problem.n
    copy_a = not (problem.stride_a == (kp, 1) and problem.align_a >= 16)
    copy_b = pad_k or pad_n or not (problem.stride_b == (np_, 1) and problem.align_b >= 16)

    def padded(t, pads):
        # F.pad always writes a fresh (aligned, contiguous) tensor; with nothing to pad, clone does the same
        return F.pad(t, pads) if any(pads) else t.clone(memory_format=torch.contiguous_format)

    def launch(a, b, out=None):
        a_p = padded(a, (0, pad_k)) if copy_a else a
        b_p = padded(b, (0, pad_n, 0, pad_k)) if copy_b else b
        if not pad_n:
            return inner_launch(a_p, b_p, out)
        full = inner_launch(a_p, b_p, None)[:, :n]
        return full.contiguous() if out is None else out.copy_(full)

    return launch


def create() -> PaddedBackend:
    return PaddedBackend()
