"""supports_cutlass() reasons, alignment fitting, ranking, the per-problem limit and the name filter."""
import re

import pytest

from backends.cutlass import CutlassBackend
from kernels.core.config import config
from kernels.space.heuristics_cutlass import (CutlassConfig, config_pool, kernel_operands, ranked_configs, score,
                                        supports_cutlass)
from kernels.core.toolchain import Toolchain
from tests.helpers import problem

SM90, SM80 = "cutlass3x_sm90_mm", "cutlass2x_sm80_mm"
SM90_I8, SM80_I8 = "cutlass3x_sm90_int8_mm", "cutlass2x_sm80_int8_mm"
BIG = CutlassConfig(128, 256, 64, 2, 1, "coop")


@pytest.mark.parametrize("la,lb", [("row", "row"), ("col", "col"), ("col", "row")])
@pytest.mark.parametrize("template", [SM90_I8, SM80_I8])
def test_int8_needs_row_by_col(template, la, lb):
    ok, why = supports_cutlass(problem(dtype="int8", la=la, lb=lb), template, None)
    assert not ok and "A row-major and B column-major" in why and f"A {la} x B {lb}" in why
    assert ranked_configs(problem(dtype="int8", la=la, lb=lb), template) == ([], {"*": why})


@pytest.mark.parametrize("template", [SM90_I8, SM80_I8])
def test_int8_row_by_col_is_offered(template):
    cfgs, _ = ranked_configs(problem(dtype="int8", la="row", lb="col"), template)
    assert cfgs and all(c.align == 16 and c.align_c == 4 for c in cfgs)


@pytest.mark.parametrize("la,lb", [("row", "row"), ("row", "col"), ("col", "row"), ("col", "col")])
def test_16bit_every_layout(la, lb):
    """Every layout of an aligned bf16 problem gets configs, each one the template supports, at full-width accesses
    (8 bf16 = 16 bytes)."""
    p = problem(la=la, lb=lb)
    for template in (SM90, SM80):
        cfgs, _ = ranked_configs(p, template)
        assert cfgs and all(c.align == 8 and c.align_c == 8 for c in cfgs)
        assert all(supports_cutlass(p, template, c) == (True, "") for c in cfgs)


def test_misaligned_pointer_reason():
    ok, why = supports_cutlass(problem(align_a=4), SM90, BIG)
    assert not ok and "A pointer is 4-byte aligned" in why and "16 bytes" in why
    # the sm80 family fits narrower accesses to the same problem: 2 bf16 = 4 bytes, cp.async's smallest copy
    cfgs, _ = ranked_configs(problem(align_a=4), SM80)
    assert cfgs and {c.align for c in cfgs} == {2}
    cfgs, rejected = ranked_configs(problem(align_a=2), SM80)
    assert cfgs == [] and all("A pointer is 2-byte aligned" in r for r in rejected.values())


def test_misaligned_leading_dim_and_extent():
    p = problem(m=256, n=256, k=100, stride_a=(100, 1))            # K=100: rows start at 200-byte steps
    ok, why = supports_cutlass(p, SM90, BIG)
    assert not ok and "A leading dimension is not a multiple of 8 elements" in why
    odd = problem(m=256, n=256, k=99, stride_a=(104, 1), stride_b=(256, 1))   # ld fine, K odd
    ok, why = supports_cutlass(odd, SM80, CutlassConfig(128, 128, 64, stages=4, warps_m=2, warps_n=2, schedule="",
                                                        align=2, align_c=8))
    assert not ok and "contiguous extent 99 is not a multiple of 2" in why
    cfgs, rejected = ranked_configs(odd, SM80)
    assert cfgs == [] and all("99" in r for r in rejected.values())


def test_output_alignment_and_schedule_rules():
    ok, why = supports_cutlass(problem(n=4100, lb="col"), SM90, BIG)
    assert not ok and "N=4100" in why
    ok, why = supports_cutlass(problem(), SM90, CutlassConfig(64, 128, 64, schedule="coop"))
    assert not ok and "tile_m >= 128" in why
    ok, why = supports_cutlass(problem(), SM90, CutlassConfig(64, 128, 64, schedule="pingpong", stream_k=True))
    assert not ok and "stream-K needs the cooperative schedule" in why


def test_arch_and_device_rules():
    assert "compute capability 9.0" in supports_cutlass(problem(arch=80), SM90, None)[1]
    assert supports_cutlass(problem(arch=80), SM80, None)[0]
    assert "CUDA" in supports_cutlass(problem(arch=0), SM80, None)[1]
    assert "fp16/bf16" in supports_cutlass(problem(dtype="fp32"), SM90, None)[1]


def test_shared_memory_rule_on_small_parts():
    cfg = CutlassConfig(128, 256, 64, schedule="", stages=3, warps_m=2, warps_n=4, align=8, align_c=8)
    assert supports_cutlass(problem(arch=80), SM80, cfg)[0]
    ok, why = supports_cutlass(problem(arch=86), SM80, cfg)
    assert not ok and "shared memory" in why


def test_tag_roundtrip_over_the_pools():
    for template in (SM90, SM80, SM90_I8, SM80_I8):
        for cfg in config_pool(template):
            assert CutlassConfig.from_tag(cfg.tag()) == cfg
            assert CutlassConfig.from_params(cfg.params()) == cfg


def test_swap_relabels_operands():
    ops = kernel_operands(problem(m=16, n=4096, la="row", lb="row"), swap=True)
    assert (ops.m, ops.n, ops.layout_a, ops.layout_b, ops.layout_c, ops.a_is) == (4096, 16, "col", "col", "col", "b")
    i8 = kernel_operands(problem(dtype="int8", la="row", lb="col"), swap=True)
    assert (i8.layout_a, i8.layout_b) == ("row", "col")     # K stays contiguous: TN maps onto TN


def test_ranking_prefers_big_cooperative_tiles_for_big_problems():
    cfgs, _ = ranked_configs(problem(8192, 8192, 8192), SM90)
    top = cfgs[0]
    assert (top.tile_m, top.tile_n) in ((128, 256), (256, 128)) and top.schedule == "coop"
    assert top.cluster_m * top.cluster_n == 2
    assert not any(c.swap for c in cfgs)                     # swap only where M is the short side


def test_ranking_prefers_small_tiles_or_stream_k_for_small_m():
    p = problem(m=16, n=4096, k=4096)
    cfgs, _ = ranked_configs(p, SM90)
    assert any(c.swap for c in cfgs)
    top = cfgs[0]
    assert top.stream_k or top.tile_m * top.tile_n <= 128 * 128
    assert score(p, SM90, CutlassConfig(64, 64, 64, schedule="pingpong", align=8, align_c=8)) > \
        score(p, SM90, CutlassConfig(256, 128, 64, 1, 2, "coop", align=8, align_c=8))


def _backend(**kwargs):
    from kernels.core.toolchain import resolve

    return CutlassBackend(Toolchain(resolve().cutlass, None, "13.0.0"), **kwargs)


def test_choices_respect_limit_by_rank_not_name():
    chosen, skipped = _backend(max_configs=3).choices(problem(8192, 8192, 8192))
    binaries = {(c.template, c.name.replace("_sw8", "_sw1")) for c in chosen}
    assert len(binaries) == 3
    assert chosen[0].name == "cutlass3x_sm90_mm_bf16_128x256x64_c2x1_coop_a8c8_sw8"
    assert all(c.template == SM90 for c in chosen)
    assert any("CUTLASS_MAX_CONFIGS" in why for why in skipped.values())
    assert sorted(c.name for c in chosen) != [c.name for c in chosen]


def test_name_filters_apply_before_the_limit():
    """KERNELS_ONLY / KERNELS_SKIP: the best of the matching kernels are built, not the matches among the best."""
    best_of_both = _backend().choices(problem())[0]
    config.only = r"cutlass2x"
    chosen, skipped = _backend().choices(problem())
    assert all(c.template == SM80 for c in chosen)
    assert len(chosen) > sum(c.template == SM80 for c in best_of_both)
    assert any("KERNELS_ONLY" in why for why in skipped.values())
    config.only = ""
    config.skip = r"pingpong,_sk_"
    chosen, _ = _backend().choices(problem())
    assert chosen and not any("pingpong" in c.name or "_sk_" in c.name for c in chosen)


def test_int8_choice_names_carry_no_duplicate_dtype():
    chosen, skipped = _backend().choices(problem(1024, 22016, 4096, dtype="int8", la="row", lb="col"))
    assert chosen and all(re.match(r"cutlass(3x_sm90|2x_sm80)_int8_mm_\d+x\d+x128_", c.name) for c in chosen)
    _, skipped = _backend().choices(problem(dtype="int8", la="row", lb="row"))
    assert set(skipped) == {SM90_I8, SM80_I8}


def test_ranked_cut_is_one_summary_line_not_one_row_per_candidate():
    chosen, skipped = CutlassBackend(max_configs=3).choices(problem(4096, 4096, 4096))
    assert chosen
    assert not any("ranked below" in why for name, why in skipped.items() if name != "cutlass (ranked cut)")
    assert re.match(r"\d+ more candidates ranked below the 3 built", skipped["cutlass (ranked cut)"])


def test_launch_leading_dimensions_follow_the_layout_and_stay_positive():
    from backends.cutlass import _leading_dim

    p = problem(m=64, n=32, k=48, la="row", lb="col", stride_a=(56, 1), stride_b=(1, 40))
    assert (_leading_dim(p, "a"), _leading_dim(p, "b")) == (56, 40)
    one_row = problem(m=1, n=32, k=48, stride_a=(0, 1))          # a broadcast row: its stride is arbitrary
    assert _leading_dim(one_row, "a") == 1


def test_sm80_kernels_are_left_out_where_an_sm90_kernel_serves():
    """On sm90 the CUTLASS 2.x kernels ran 1.8-2.8x the best candidate (H200, default bf16 set); on an sm80 card
    they are the only CUTLASS kernels."""
    from backends.cutlass import CutlassBackend
    from kernels.space.heuristics_cutlass import SM80_ON_SM90

    backend = CutlassBackend()
    chosen, skipped = backend.choices(problem(4096, 4096, 4096, arch=90))
    assert chosen and all(c.template.startswith("cutlass3x_sm90") for c in chosen)
    assert skipped["cutlass2x_sm80_mm"] == SM80_ON_SM90
    chosen, skipped = backend.choices(problem(4096, 4096, 4096, arch=80))
    assert chosen and all(c.template == "cutlass2x_sm80_mm" for c in chosen) and "cutlass2x_sm80_mm" not in skipped


def test_overlapping_rows_are_refused_by_tma_kernels_only():
    broadcast = problem(m=256, n=256, k=256, stride_b=(0, 1))      # B = w.expand(K, N): every row the same
    ok, why = supports_cutlass(broadcast, SM90, BIG)
    assert not ok and "B's rows overlap" in why
    ok, why = supports_cutlass(broadcast, SM80, CutlassConfig(128, 128, 64, stages=4, warps_m=2, warps_n=2,
                                                              schedule="", align=8, align_c=8))
    assert ok, why

