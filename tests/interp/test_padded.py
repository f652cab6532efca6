"""padded: misaligned problems run through aligned, zero-padded copies (interpreter on CPU; GPU in gpu tests)."""
import pytest
import torch

from backends.padded import PaddedBackend, inner_problem, is_aligned, padded_dims
from kernels.core.config import interpret_mode
from kernels.core.problem import GemmProblem
from tests.helpers import problem
from tests.triton_helpers import assert_close, build_offered, build_padded, check_launches, operand

interpreted = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")


def test_offered_only_for_misaligned_problems():
    assert is_aligned(problem(m=2048, n=2048, k=2048))
    odd = problem(m=2047, n=2047, k=2047)
    assert not is_aligned(odd)
    assert padded_dims(odd) == (2048, 2048)
    assert not PaddedBackend().available(problem(m=2048, n=2048, k=2048))[0]
    inner = inner_problem(odd)
    assert (inner.k, inner.n, inner.stride_a, inner.stride_b) == (2048, 2048, (2048, 1), (2048, 1))
    assert inner_problem(problem(m=40, n=33, k=65, dtype="int8", op="int_mm")).n == 48
    # no padded template for fp8 (its K and N are multiples of 16 anyway): said, even for a misaligned pointer
    fp8 = problem(m=40, n=32, k=64, dtype="e4m3", op="scaled_mm", lb="col", align_a=1)
    assert PaddedBackend().available(fp8) == (False, "no padded template for scaled_mm")


def test_hoppers_largest_tiles_join_the_inner_configs_where_they_fill_a_wave():
    import dataclasses

    from backends.padded import INNER_TRITON_CONFIGS, inner_triton_configs

    def tags(p, template="triton_mm"):
        return [c.tag() for c in inner_triton_configs(inner_problem(p), template, "default")]

    odd = problem(m=2047, n=2047, k=2047)                 # 2048^3 inside: 128 tiles of 128x256 on 132 SMs
    assert tags(odd)[INNER_TRITON_CONFIGS:] == ["128x256x64_s3_w8_g8", "256x128x64_s4_w8_g8"]
    assert len(tags(dataclasses.replace(odd, arch=80))) == INNER_TRITON_CONFIGS       # no wgmma before Hopper
    assert len(tags(problem(m=1500, n=1500, k=1500))) == INNER_TRITON_CONFIGS          # 72 tiles: not a wave
    int8 = tags(problem(m=2047, n=2047, k=2047, dtype="int8", op="int_mm"), "triton_int8_mm")
    assert len(int8) == len(set(int8)) and "256x128x64_s4_w8_g8" in int8


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("m,n,k,la,lb", [(17, 33, 65, "row", "row"), (40, 9, 31, "col", "row"),
                                         (33, 47, 200, "strided", "col")])
def test_every_padded_choice_matches_torch(dtype, m, n, k, la, lb):
    a, b = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    outcomes, skipped = build_padded(a, b)
    assert len(outcomes) >= (1 if dtype == torch.int8 else 2) and not skipped
    for outcome in outcomes:
        check_launches(outcome.runner, a, b)


@interpreted
def test_misaligned_pointer_is_copied():
    base = torch.randn(16 * 24 + 1).to(torch.float16)
    a = base[1:].view(16, 24)                       # 2-byte aligned pointer, aligned leading dimension
    b = torch.randn(24, 16).to(torch.float16)
    p = GemmProblem.from_tensors("mm", a, b)
    assert p.align_a == 2 and not is_aligned(p)
    outcomes = build_padded(a, b, require_available=True)[0]
    assert outcomes
    for outcome in outcomes:
        assert_close(outcome.runner.launch(a, b, None), a, b)


@interpreted
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
@pytest.mark.parametrize("m,n,k,la,lb", [(17, 33, 65, "row", "row"), (40, 9, 31, "col", "row"),
                                         (33, 47, 200, "strided", "col")])
@pytest.mark.parametrize("inner", ["", "tma_"])
def test_two_launch_triton_padded_matches_torch(dtype, m, n, k, la, lb, inner):
    """triton_padded_* and triton_padded_tma_*: one copy kernel for both operands, then the mm (tiled, or persistent
    over descriptors with a pointer epilogue) writing the N-wide output directly."""

    a, b = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    template = f"triton_padded_{inner}int8_mm" if dtype == torch.int8 else f"triton_padded_{inner}mm"
    for outcome in build_offered(template, a, b, limit=2, require=True):
        check_launches(outcome.runner, a, b, calls=2)       # the padded buffers are reused between calls


@interpreted
@pytest.mark.parametrize("template", ["triton_padded_mm", "triton_padded_tma_mm", "triton_padded_int8_mm",
                                      "triton_padded_tma_int8_mm"])
@pytest.mark.parametrize("la,lb", [("row", "row"), ("col", "sliced"), ("strided", "col")])
def test_padded_products_over_many_tiles(template, la, lb):
    """Small tiles on a larger odd problem: many output tiles (the persistent kernel loops over several per
    program), partial edge tiles, the pointer epilogue's row and column masks."""
    from backends.triton import TritonBackend
    from kernels.core.choice import Choice
    from kernels.space.heuristics import GemmConfig

    dtype = torch.int8 if "int8" in template else torch.float16
    a, b = operand(100, 70, la, dtype), operand(70, 150, lb, dtype)
    p = GemmProblem.from_tensors("int_mm" if dtype == torch.int8 else "mm", a, b)
    assert not is_aligned(p)
    (outcome,) = TritonBackend().build(p, [Choice("triton", template, p.dtype, GemmConfig(32, 32, 32, 2, 4))])
    assert outcome.runner is not None, outcome.error
    check_launches(outcome.runner, a, b, calls=2)


def test_padded_choices_of_a_problem_share_one_copy_kernel():
    from backends.triton import triton_version
    from backends.triton_render import build_key, render
    from backends.triton_templates import family
    from kernels.core.choice import Choice
    from kernels.space.heuristics import GemmConfig

    odd = problem(m=2047, n=2047, k=2047)
    keys = set()
    for template, cfg in (("triton_padded_mm", GemmConfig(128, 128, 64, 3, 8)),
                          ("triton_padded_mm", GemmConfig(64, 128, 32, 4, 4)),
                          ("triton_padded_tma_mm", GemmConfig(128, 256, 64, 3, 8))):
        copy = family(template).specs(odd, Choice("triton", template, "bf16", cfg))[0]
        keys.add(build_key(render(copy), copy, "cuda:90", triton_version()))
    assert len(keys) == 1
    int8 = problem(m=2047, n=2047, k=2047, dtype="int8", op="int_mm")
    copy = family("triton_padded_int8_mm").specs(int8, Choice("triton", "triton_padded_int8_mm", "int8",
                                                              GemmConfig(128, 128, 64, 3, 8)))[0]
    assert build_key(render(copy), copy, "cuda:90", triton_version()) not in keys     # K-major B: another copy


def test_padded_tma_offered_on_hopper_only_and_as_the_mm_inner_is():
    from backends.triton_templates import family

    fam = family("triton_padded_tma_mm")
    odd = problem(m=2047, n=2047, k=2047)
    names = [c.name for c in fam.choices(odd, "triton_padded_tma_mm", "default")[0]]
    assert names and len(names) <= 6 and "triton_padded_tma_mm_bf16_128x256x64_s3_w8_g8" in names
    exhaustive = [c.name for c in fam.choices(odd, "triton_padded_tma_mm", "exhaustive")[0]]
    assert len(exhaustive) == len(names)                    # capped in every space, as the tiled inner is
    import dataclasses
    assert "sm90" in fam.choices(dataclasses.replace(odd, arch=80), "triton_padded_tma_mm", "default")[1][
        "triton_padded_tma_mm"]
    assert "aligned" in fam.choices(problem(), "triton_padded_tma_mm", "default")[1]["triton_padded_tma_mm"]


def test_two_launch_padded_not_offered_for_aligned_problems():
    from backends.triton_templates import family

    choices, skipped = family("triton_padded_mm").choices(problem(), "triton_padded_mm", "default")
    assert choices == [] and "aligned" in skipped["triton_padded_mm"]


def test_backends_that_leave_aten_out_and_cannot_run_a_problem_get_aten_added(isolated_cache):
    """KERNELS_BACKENDS=padded and an aligned problem (padded serves only misaligned ones), as KERNELS_BACKENDS=cutlass
    before its set is built: no candidate of the setting can run it. kernels.mm serves it through aten (a warning,
    and a note in the selection) instead of raising on a valid call (a new user's probe)."""
    import warnings

    import kernels
    from kernels.dispatch.selected import BackendsFallbackWarning

    kernels.config.backends = ("padded",)
    a, b = torch.randn(4, 16, dtype=torch.float16), torch.randn(16, 16, dtype=torch.float16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = kernels.mm(a, b)
    assert_close(out, a, b)
    assert any(issubclass(w.category, BackendsFallbackWarning) and "no candidate of padded" in str(w.message)
               for w in caught)
    sel = kernels.explain(a, b)
    assert sel.winner.startswith("aten") and "aten added to the tune" in sel.notes[-1]
