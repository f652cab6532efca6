"""The CUTLASS fp8 family (cutlass3x_sm90_scaled_mm) without a GPU: the epilogue visitor tree each scaling, bias and
swap renders, the entry points' signature, what supports_cutlass() refuses and why, the pool, the launch's pointer
order, the ninja edge and the (absent) default set. Compiles: tests/interp/test_cutlass_compile.py; GPU:
tests/gpu/test_cutlass.py."""
import ctypes
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backends.cutlass import CUTLASS_MAX_CONFIGS, CutlassBackend, make_launcher
from backends.cutlass_render import BuildJob, build_key, ninja_text, render, spec_for
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.space.heuristics_cutlass import CutlassConfig, config_pool, fit_alignment, ranked_configs, supports_cutlass
from kernels.tune import warmup
from tests.helpers import problem

FP8 = "cutlass3x_sm90_scaled_mm"
COOP = CutlassConfig(128, 128, 128, 2, 1, "coop")
PINGPONG = CutlassConfig(64, 128, 128, 1, 1, "pingpong")


def scaled(m=4096, n=4096, k=4096, dtype="e4m3", out="bf16", scaling="tensor", bias=False, **kw) -> GemmProblem:
    """A scaled_mm problem as kernels.scaled_mm makes it: A row-major, B column-major unless told otherwise."""
    kw.setdefault("la", "row")
    kw.setdefault("lb", "col")
    return replace(problem(m, n, k, dtype=dtype, op="scaled_mm", **kw), out_dtype=out, scaling=scaling, bias=bias)


def fitted(p: GemmProblem, cfg: CutlassConfig, swap: bool = False) -> CutlassConfig:
    return fit_alignment(p, FP8, replace(cfg, swap=swap))


def choice_for(p: GemmProblem, cfg: CutlassConfig, swap: bool = False) -> Choice:
    return Choice("cutlass", FP8, p.dtype, None, fitted(p, cfg, swap).params())


def source(p: GemmProblem, cfg: CutlassConfig = COOP, swap: bool = False) -> str:
    return render(spec_for(p, choice_for(p, cfg, swap)))


def run_signature(src: str) -> str:
    [signature] = re.findall(r"int kernels_cutlass_run\([^)]*\)", src)
    return " ".join(signature.split())


# -- rendering ------------------------------------------------------------------------------------------------------
def test_tensor_scaling_is_one_scalar_broadcast_of_both_scales():
    src = source(scaled(scaling="tensor"))
    assert "using ElementA = cutlass::float_e4m3_t;" in src and "using ElementB = cutlass::float_e4m3_t;" in src
    assert "using ElementD = cutlass::bfloat16_t;" in src and "using ElementAccumulator = float;" in src
    assert "cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8FastAccum>::CollectiveOp;" in src
    assert "cutlass::epilogue::TmaWarpSpecializedCooperative, FusionCallbacks>::CollectiveOp;" in src
    # both scales read from device memory (no host sync) and multiplied into one factor: a reduction of two
    assert "using Factor = fusion::Sm90ScalarBroadcast<ElementCompute, Stride<_0, _0, _0>, 2>;" in src
    assert "using Scaled = Accumulator;" in src and "using Accumulator = fusion::Sm90AccFetch;" in src
    assert "typename Factor::Arguments factor{ {ElementCompute(1), ElementCompute(1)}, {sa, sb}, {} };" in src
    assert ("fusion::Sm90Compute<cutlass::multiplies, ElementD, ElementCompute, RoundStyle>,\n    Factor, Scaled>;"
            in src)
    assert "Broadcast<0," not in src and "Bias" not in src          # no vectors at all
    assert "args.epilogue.thread = fusion_arguments(scale_a, scale_b);" in src
    assert "alpha" not in src and "FusionOperation" not in src       # none of mm's named fusion operations
    assert run_signature(src) == ("int kernels_cutlass_run(const void* A, const void* B, const void* scale_a, const "
                                  "void* scale_b, void* D, int M, int N, int K, int64_t lda, int64_t ldb, int64_t ldd, "
                                  "void* workspace, int swizzle, void* stream)")
    assert "make_arguments(nullptr, nullptr, nullptr, nullptr, nullptr, M, N, K" in src
    assert "// D = (A @ B) * scale_a * scale_b (per-tensor scales) with M, N, K" in src
    assert "{{" not in src and "{%" not in src


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_row_scaling_broadcasts_each_scale_along_its_axis(swap, bias):
    """scale_a is one value per row of A and scale_b (and the bias) one per column of B: kernel rows and columns,
    exchanged when the kernel computes C^T = B^T A^T."""
    p = scaled(m=64, scaling="row", bias=bias)
    src = source(p, PINGPONG, swap)
    assert ("using PerRowScale = fusion::Sm90ColBroadcast<0, TileShape, ElementCompute, ElementCompute, "
            "Stride<_1, _0, int64_t>, 1>;") in src
    assert ("using PerColScale = fusion::Sm90RowBroadcast<0, TileShape, ElementCompute, ElementCompute, "
            "Stride<_0, _1, int64_t>, 1>;") in src
    assert f"using ScaleA = Per{'Col' if swap else 'Row'}Scale;" in src
    assert f"using ScaleB = Per{'Row' if swap else 'Col'}Scale;" in src
    assert "using Factor = ScaleA;" in src and "ScaleB, Accumulator>;    // scale_b * acc" in src
    assert "typename Factor::Arguments factor{sa, ElementCompute(0), {}};" in src
    assert "typename Scaled::Arguments scaled{ {sb, ElementCompute(0), {}}, {}, {} };" in src
    assert ("using LayoutD = cutlass::layout::ColumnMajor;" in src) == swap
    assert "KernelTmaWarpSpecializedPingpongFP8FastAccum>::CollectiveOp;" in src
    assert "cutlass::epilogue::TmaWarpSpecialized, FusionCallbacks>::CollectiveOp;" in src
    op = "cutlass::homogeneous_multiply_add" if bias else "cutlass::multiplies"
    children = "Factor, Scaled, Bias>;" if bias else "Factor, Scaled>;"
    assert f"fusion::Sm90Compute<{op}, ElementD, ElementCompute, RoundStyle>,\n    {children}" in src
    assert (f"using Bias = Per{'Row' if swap else 'Col'}Bias;" in src) == bias
    assert ("typename Bias::Arguments bias_vector{static_cast<ElementBias const*>(bias), ElementBias(0), {}};"
            in src) == bias
    pointers = "const void* scale_a, const void* scale_b, " + ("const void* bias, " if bias else "")
    assert run_signature(src).startswith(f"int kernels_cutlass_run(const void* A, const void* B, {pointers}void* D,")
    assert ("args.epilogue.thread = fusion_arguments(scale_a, scale_b, bias);" in src) == bias
    assert "{{" not in src and "{%" not in src


def test_tensor_scaling_with_bias_adds_a_bias_vector():
    src = source(scaled(scaling="tensor", bias=True))
    assert "using Factor = fusion::Sm90ScalarBroadcast<ElementCompute, Stride<_0, _0, _0>, 2>;" in src
    assert "using Bias = PerColBias;" in src and "return {factor, scaled, bias_vector, {}};" in src
    assert "// D = (A @ B) * scale_a * scale_b + bias (per-tensor scales)" in src


@pytest.mark.parametrize("swap", [False, True])
def test_e5m2_a_is_the_kernels_b_when_swapped(swap):
    src = source(scaled(m=16, dtype="e5m2"), PINGPONG, swap)
    kernel_a, kernel_b = ("e4m3", "e5m2") if swap else ("e5m2", "e4m3")
    assert f"using ElementA = cutlass::float_{kernel_a}_t;" in src
    assert f"using ElementB = cutlass::float_{kernel_b}_t;" in src


@pytest.mark.parametrize("out,element,align_c", [("bf16", "cutlass::bfloat16_t", 8), ("fp16", "cutlass::half_t", 8),
                                                 ("fp32", "float", 4)])
def test_output_dtypes(out, element, align_c):
    p = scaled(out=out, scaling="row", bias=True)
    src = source(p)
    assert f"using ElementD = {element};" in src and f"constexpr int AlignmentD = {align_c};" in src
    assert "constexpr int AlignmentAB = 16;" in src and "Shape<_128, _128, _128>" in src
    assert "using ElementBias = ElementD;" in src      # the bias has the output's dtype (torch._scaled_mm's rule)


def test_sources_are_shape_agnostic_and_every_epilogue_is_its_own_binary():
    c = choice_for(scaled(), COOP)
    assert source(scaled(4096, 4096, 4096)) == source(scaled(17, 2048, 4112))
    keys = set()
    for scaling in ("tensor", "row"):
        for bias in (False, True):
            for out in ("bf16", "fp16", "fp32"):
                p = scaled(scaling=scaling, bias=bias, out=out)
                c = choice_for(p, COOP)
                spec = spec_for(p, c)
                keys.add(build_key(render(spec), spec, "13.0.88", "4.2.0"))
                assert c.name.endswith("_bias" if bias else "_sw1")     # the scaling and out dtype are the problem's
    assert len(keys) == 2 * 2 * 3


def test_plain_and_mm_epilogue_sources_are_unchanged_by_the_fp8_family():
    """mm's sources carry nothing of the scaled tree: their binaries keep their build keys."""
    mm = render(spec_for(problem(la="row", lb="col"), Choice("cutlass", "cutlass3x_sm90_mm", "bf16", None,
                                                              CutlassConfig(128, 128, 64, 2, 1, "coop", align=8,
                                                                            align_c=8).params())))
    assert "scale" not in mm and "FP8" not in mm and "fusion::" not in mm and "RoundStyle" not in mm
    assert "using ElementA = cutlass::bfloat16_t;\nusing ElementB = cutlass::bfloat16_t;" in mm


def test_flags_and_ninja_edge_target_sm90a(tmp_path):
    p = scaled(scaling="row", bias=True)
    spec = spec_for(p, choice_for(p, COOP))
    assert spec.flags[:2] == ("-gencode", "arch=compute_90a,code=sm_90a") and "-DNDEBUG" in spec.flags
    job = BuildJob(tmp_path / "k" / "kernel.cu", tmp_path / "k" / "kernel.so", tmp_path / "k" / "build.log",
                   spec.flags, (Path("/opt/cutlass/include"),))
    text = ninja_text("/usr/local/bin/nvcc", [job])
    assert f"build {tmp_path}/k/kernel.so: nvcc_shared {tmp_path}/k/kernel.cu" in text
    assert "  flags = -gencode arch=compute_90a,code=sm_90a -std=c++17 -O3 -DNDEBUG" in text
    assert "-I/opt/cutlass/include" in text


def test_a_scaled_problem_has_no_sm80_kernel():
    cfg = CutlassConfig(128, 128, 128, schedule="", stages=4, warps_m=2, warps_n=2, align=16, align_c=8)
    with pytest.raises(ValueError, match="sm90 kernels only"):
        spec_for(scaled(), Choice("cutlass", "cutlass2x_sm80_int8_mm", "e4m3", None, cfg.params()))


# -- what the family supports --------------------------------------------------------------------------------------
@pytest.mark.parametrize("la,lb", [("row", "row"), ("col", "col"), ("col", "row")])
def test_fp8_needs_a_and_b_k_major(la, lb):
    p = scaled(la=la, lb=lb)
    ok, why = supports_cutlass(p, FP8, None)
    assert not ok and "e4m3 CUTLASS kernels need A row-major and B column-major" in why and f"A {la} x B {lb}" in why
    assert ranked_configs(p, FP8) == ([], {"*": why})


@pytest.mark.parametrize("change,reason", [
    (dict(arch=80), "sm_90a kernels need compute capability 9.0, device has 8.0"),
    (dict(arch=100), "sm_90a kernels need compute capability 9.0, device has 10.0"),
    (dict(align_a=8), "A pointer is 8-byte aligned, the kernel loads 16 bytes at a time"),
    (dict(align_b=4), "B pointer is 4-byte aligned, the kernel loads 16 bytes at a time"),
    (dict(stride_a=(4104, 1)), "A leading dimension is not a multiple of 16 elements"),
    (dict(k=4104, stride_a=(4112, 1), stride_b=(1, 4112)), "A's contiguous extent 4104 is not a multiple of 16"),
])
def test_what_tma_cannot_feed_is_refused_with_the_reason(change, reason):
    p = scaled(m=256, n=256, k=change.pop("k", 4096), **change)
    ok, why = supports_cutlass(p, FP8, fitted(p, COOP))
    assert not ok and reason in why, why


@pytest.mark.parametrize("problem_,reason", [
    (replace(scaled(), scaling=""), "needs the scales per tensor or row-wise (tensor/row), not ''"),
    (replace(scaled(), activation="relu"), "fuses the scales and a bias, no activation (relu)"),
    (scaled(out="e4m3"), "writes bf16/fp16/fp32, not e4m3"),
    (replace(problem(la="row", lb="col"), scaling="tensor"), "fuses no scales into mm"),
])
def test_epilogue_rules(problem_, reason):
    template = FP8 if problem_.op == "scaled_mm" else "cutlass3x_sm90_mm"
    ok, why = supports_cutlass(problem_, template, None)
    assert not ok and reason in why, why


def test_other_templates_do_not_implement_scaled_mm():
    for template in ("cutlass3x_sm90_mm", "cutlass3x_sm90_int8_mm", "cutlass2x_sm80_int8_mm"):
        ok, why = supports_cutlass(scaled(), template, None)
        assert not ok and f"{template} does not implement scaled_mm" in why
    ok, why = supports_cutlass(problem(dtype="int8", la="row", lb="col"), FP8, None)
    assert not ok and "does not implement int_mm" in why


def test_the_pool_is_the_sm90_pool_with_128_bytes_of_k():
    pool = config_pool(FP8)
    assert pool and {c.tile_k for c in pool} == {128} and {c.schedule for c in pool} == {"coop", "pingpong"}
    tiles = {(c.tile_m, c.tile_n, c.schedule) for c in pool}
    assert {(128, 128, "coop"), (128, 256, "coop"), (256, 128, "coop"), (64, 128, "pingpong")} <= tiles
    assert {(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.schedule, c.stream_k, c.swap) for c in pool} == \
        {(c.tile_m, c.tile_n, c.cluster_m, c.cluster_n, c.schedule, c.stream_k, c.swap)
         for c in config_pool("cutlass3x_sm90_int8_mm")}


@pytest.mark.parametrize("m,swapped", [(1, True), (17, True), (4096, False)])
def test_choices_are_a_modest_ranked_set_with_swapped_twins_for_small_m(m, swapped):
    p = scaled(m=m, n=4096, k=4112, scaling="row", bias=True)
    chosen, skipped = CutlassBackend().choices(p)
    assert 0 < len({c.name.replace("_sw8", "_sw1") for c in chosen}) <= CUTLASS_MAX_CONFIGS
    assert all(c.template == FP8 and c.name.startswith(f"{FP8}_e4m3_") and c.name.endswith("_bias") for c in chosen)
    assert any("_swap_" in c.name for c in chosen) == swapped
    for c in chosen:
        cfg = CutlassConfig.from_params(c.params)
        assert cfg.align == 16 and cfg.align_c == 8 and supports_cutlass(p, FP8, cfg) == (True, "")
    assert not any("sm80" in name for name in skipped)


def test_an_sm80_device_gets_no_choice_and_the_reason():
    chosen, skipped = CutlassBackend().choices(scaled(arch=80))
    assert chosen == [] and skipped == {FP8: "sm_90a kernels need compute capability 9.0, device has 8.0"}


# -- the launch ------------------------------------------------------------------------------------------------------
class _FakeKernel:
    """A LoadedKernel whose entry points record their arguments instead of launching."""

    def __init__(self):
        self.calls = []

    def workspace_size(self, m, n, k, swizzle, size):
        return 0

    def run(self, *args):
        self.calls.append(args)
        return 0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_launch_passes_the_scales_then_the_bias_in_the_problems_order(monkeypatch, swap, bias):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    p = scaled(m=17, n=64, k=32, scaling="row", bias=bias)
    kernel = _FakeKernel()
    launch = make_launcher(kernel, p, fitted(p, PINGPONG, swap))
    a, b = torch.ones(17, 32), torch.ones(64, 32).t()
    scale_a, scale_b = torch.ones(17, 1), torch.ones(1, 64)
    storage = torch.zeros(80)
    epilogue = (scale_a, scale_b) + ((storage[1:65],) if bias else ())     # a bias off 16-byte alignment
    out = launch(a, b, *epilogue)
    args = kernel.calls[-1]
    assert args[:2] == ((b.data_ptr(), a.data_ptr()) if swap else (a.data_ptr(), b.data_ptr()))
    assert args[2:4] == (scale_a.data_ptr(), scale_b.data_ptr())           # whatever the swap: the kernel knows
    pointers = 5 if bias else 4
    assert args[pointers] == out.data_ptr() and args[pointers + 1:pointers + 3] == ((64, 17) if swap else (17, 64))
    if bias:
        assert args[4] != storage[1:65].data_ptr() and args[4] % 16 == 0   # an aligned copy
    given = torch.empty(17, 64)
    assert launch(a, b, *epilogue, given) is given and kernel.calls[-1][pointers] == given.data_ptr()


def test_a_strided_scale_is_passed_as_a_contiguous_copy(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    p = scaled(m=16, n=64, k=32, scaling="row")
    kernel = _FakeKernel()
    seen = []
    # read what the kernel would read, while the call holds the copy: 16 fp32 at unit stride from the pointer
    kernel.run = lambda *args: seen.append(list((ctypes.c_float * 16).from_address(args[2]))) or 0
    launch = make_launcher(kernel, p, fitted(p, COOP))
    strided = torch.arange(32.0).reshape(16, 2)[:, :1]                      # (16, 1) at stride 2
    launch(torch.ones(16, 32), torch.ones(64, 32).t(), strided, torch.ones(1, 64))
    assert seen == [strided.flatten().tolist()] == [[2.0 * i for i in range(16)]]


# -- the default set -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_fp8_has_no_default_set_and_says_why(dtype):
    cset = warmup.default_set(90, dtype)
    assert cset.work == [] and not cset.kernels and "no default CUTLASS set for fp8" in cset.why_not
    assert dtype not in warmup.DTYPES
