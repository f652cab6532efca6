import pytest
import torch

from kernels.space.heuristics import (GemmConfig, candidate_configs, config_list, exhaustive_configs, scale_config,
                                shared_memory_bytes, supports)
from kernels.core.problem import GemmProblem
from tests.helpers import problem


def test_inductor_lists_have_expected_sizes():
    assert len(config_list("mm_configs")) == 19
    assert len(config_list("int8_mm_configs")) == 11
    assert len(exhaustive_configs()) == 5 * 5 * 5 * 5 * 3


def test_scaling_clamps_to_next_pow2_with_minimums():
    cfg = GemmConfig(128, 128, 64, 3, 4)
    assert scale_config(cfg, problem(m=17, n=33, k=5)) == GemmConfig(32, 64, 16, 3, 4)
    assert scale_config(cfg, problem(m=1, n=1, k=1)) == GemmConfig(16, 16, 16, 3, 4)
    int8 = scale_config(cfg, problem(m=1, n=1, k=1, dtype="int8", op="int_mm"))
    assert int8.block_k == 32


def test_shared_memory_pruning_drops_inductor_config_that_fails_on_hopper():
    cfg = GemmConfig(128, 128, 128, 4, 8)
    assert shared_memory_bytes(cfg, problem()) == 262_144
    ok, why = supports(problem(), "triton_mm", cfg)
    assert not ok and "shared memory 262144 B > 232448 B" in why
    assert supports(problem(), "triton_mm", GemmConfig(128, 128, 64, 3, 4)) == (True, "")


def test_register_bound_and_int8_rules():
    ok, why = supports(problem(), "triton_mm", GemmConfig(256, 256, 16, 1, 2))
    assert not ok and "registers" in why
    ok, why = supports(problem(dtype="int8", op="int_mm"), "triton_int8_mm", GemmConfig(64, 64, 16, 2, 4))
    assert not ok and "block_k >= 32" in why
    ok, why = supports(problem(), "triton_int8_mm", GemmConfig(64, 64, 32, 2, 4))
    assert not ok and "does not implement mm" in why


def test_32bit_offsets_rule():
    big = problem(m=70000, n=70000, k=64)
    ok, why = supports(big, "triton_mm", GemmConfig(64, 64, 32, 2, 4))
    assert not ok and "32-bit" in why


def test_candidates_are_scaled_deduped_and_supported():
    small = problem(m=16, n=16, k=16)
    cands = candidate_configs(small, "triton_mm")
    assert len(cands) == len(set(cands))
    assert all(c.block_m == 16 and c.block_n == 16 and c.block_k == 16 for c in cands)
    assert all(supports(small, "triton_mm", c)[0] for c in cands)
    big = candidate_configs(problem(), "triton_mm")
    assert len(big) == 19


def test_exhaustive_space_is_pruned_on_smaller_shared_memory():
    hopper = candidate_configs(problem(), "triton_mm", "exhaustive")
    ampere_consumer = candidate_configs(problem(arch=86), "triton_mm", "exhaustive")
    pipelined = [c for c in ampere_consumer if c.num_stages >= 2]
    assert len(pipelined) < len(hopper) < 1875
    assert all(shared_memory_bytes(c, problem()) <= 101_376 for c in ampere_consumer)


def test_hoppers_exhaustive_space_leaves_out_unpipelined_configs():
    from kernels.space.heuristics import MIN_EXHAUSTIVE_STAGES_SM90

    hopper = candidate_configs(problem(), "triton_mm", "exhaustive")
    ampere = candidate_configs(problem(arch=80), "triton_mm", "exhaustive")
    default = candidate_configs(problem(), "triton_mm", "default")
    assert MIN_EXHAUSTIVE_STAGES_SM90 == 2 and any(c.num_stages == 1 for c in default)
    assert {c for c in hopper if c.num_stages == 1} == {c for c in default if c.num_stages == 1}
    assert set(default) <= set(hopper)                                  # exhaustive still covers default
    assert sum(c.num_stages == 1 for c in ampere) > 10 * sum(c.num_stages == 1 for c in hopper)


@pytest.mark.parametrize("shape,stride,layout", [((4, 8), (8, 1), "row"), ((4, 8), (1, 4), "col"),
                                                 ((4, 8), (16, 2), "strided"), ((1, 8), (3, 5), "col"),
                                                 ((4, 1), (7, 3), "row")])
def test_layout_detection(shape, stride, layout):
    from kernels.core.problem import layout_of

    assert layout_of(shape, stride) == layout


def test_problem_from_tensors_and_key_roundtrip():
    a = torch.randn(8, 32)[:, :16]       # sliced view: leading dim 32 > row length 16
    b = torch.randn(24, 16).t()          # column-major
    p = GemmProblem.from_tensors("mm", a, b)
    assert (p.m, p.n, p.k, p.layout_a, p.layout_b) == (8, 24, 16, "row", "col")
    assert p.stride_a == (32, 1) and p.precision in ("ieee", "tf32")
    assert GemmProblem.from_dict(__import__("json").loads(p.key())) == p
