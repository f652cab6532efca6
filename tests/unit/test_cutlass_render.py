"""Pure parts of the CUTLASS build: rendering each family and each fused epilogue, flags, artifact keys, the ninja
file, artifact markers, the launch's arguments, and the isolated child's protocol parsing."""
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from backends.cutlass import ArtifactPaths, CutlassBackend, artifact_valid, make_launcher, publish_marker
from backends.isolated_child import TAG, _parse
from backends.cutlass_render import BuildJob, build_key, ninja_text, render, spec_for
from kernels.core.choice import Choice
from kernels.space.heuristics_cutlass import CutlassConfig, ranked_configs, supports_cutlass
from tests.helpers import problem


def choice(template, cfg, dtype="bf16"):
    return Choice("cutlass", template, dtype, None, cfg.params())


SM90_CFG = CutlassConfig(128, 256, 64, 2, 1, "coop", stream_k=True, align=8, align_c=8, swizzle=8)
SM80_CFG = CutlassConfig(128, 128, 64, schedule="", stages=4, warps_m=2, warps_n=2, align=8, align_c=8)


def test_sm90_render_structure():
    p = problem(la="row", lb="col")
    spec = spec_for(p, choice("cutlass3x_sm90_mm", SM90_CFG))
    assert spec.config.swizzle == 1            # run-time argument on sm90: not part of the binary
    src = render(spec)
    assert "using ElementA = cutlass::bfloat16_t;" in src and "using ElementD = cutlass::bfloat16_t;" in src
    assert "using LayoutA = cutlass::layout::RowMajor;" in src
    assert "using LayoutB = cutlass::layout::ColumnMajor;" in src
    assert "Shape<_128, _256, _64>" in src and "Shape<_2, _1, _1>" in src
    assert "cutlass::gemm::KernelTmaWarpSpecializedCooperative" in src
    assert "cutlass::epilogue::TmaWarpSpecializedCooperative" in src
    assert "cutlass::gemm::StreamKScheduler" in src
    assert re.search(r'extern "C" \{.*int kernels_cutlass_workspace_size\(.*int kernels_cutlass_run\(', src, re.S)
    assert "{{" not in src and "{%" not in src
    assert spec.flags[:2] == ("-gencode", "arch=compute_90a,code=sm_90a") and "-DNDEBUG" in spec.flags


def test_sm90_pingpong_int8_and_swap():
    p = problem(m=16, n=4096, dtype="int8", la="row", lb="col")
    cfg = CutlassConfig(64, 128, 128, 1, 1, "pingpong", swap=True, align=16, align_c=4)
    src = render(spec_for(p, choice("cutlass3x_sm90_int8_mm", cfg, "int8")))
    assert "using ElementA = int8_t;" in src and "using ElementD = int32_t;" in src
    assert "using ElementAccumulator = int32_t;" in src
    assert "KernelTmaWarpSpecializedPingpong" in src and "cutlass::epilogue::TmaWarpSpecialized>" in src
    assert "cutlass::gemm::PersistentScheduler" in src
    assert "using LayoutD = cutlass::layout::ColumnMajor;" in src     # swapped: C^T = B^T A^T


def test_sm80_render_structure():
    p = problem(la="col", lb="row", arch=90)
    spec = spec_for(p, choice("cutlass2x_sm80_mm", SM80_CFG))
    src = render(spec)
    assert "cutlass::gemm::device::Gemm<" in src
    assert "GemmShape<128, 128, 64>" in src and "GemmShape<64, 64, 64>" in src and "GemmShape<16, 8, 16>" in src
    assert "using LayoutA = cutlass::layout::ColumnMajor;" in src and "using LayoutB = cutlass::layout::RowMajor;" in src
    assert re.search(r"4, 8, 8, false, cutlass::arch::OpMultiplyAdd>", src)
    assert spec.flags[:2] == ("-gencode", "arch=compute_80,code=sm_90")
    i8 = render(spec_for(problem(dtype="int8", la="row", lb="col", arch=80), choice(
        "cutlass2x_sm80_int8_mm", CutlassConfig(128, 128, 128, schedule="", stages=4, warps_m=2, warps_n=2, align=16,
                                                align_c=4), "int8")))
    assert "GemmShape<16, 8, 32>" in i8 and "OpMultiplyAddSaturate" in i8
    assert "LinearCombination<ElementD, 4, ElementAccumulator, ElementCompute>" in i8


def test_build_key_tracks_source_compiler_flags_arch():
    p = problem()
    spec = spec_for(p, choice("cutlass2x_sm80_mm", SM80_CFG))
    src = render(spec)
    key = build_key(src, spec, "13.0.88", "4.2.0")
    assert key == build_key(src, spec, "13.0.88", "4.2.0")
    spec80 = spec_for(problem(arch=80), choice("cutlass2x_sm80_mm", SM80_CFG))
    assert len({key, build_key(src + " ", spec, "13.0.88", "4.2.0"), build_key(src, spec, "12.8.0", "4.2.0"),
                build_key(src, spec80, "13.0.88", "4.2.0"), build_key(src, spec, "13.0.88", "4.1.0")}) == 5


def test_shape_agnostic_sources():
    c = choice("cutlass3x_sm90_mm", SM90_CFG)
    assert render(spec_for(problem(4096, 4096, 4096), c)) == render(spec_for(problem(1000, 3000, 512), c))


def test_ninja_text_is_pure_and_complete(tmp_path):
    jobs = [BuildJob(tmp_path / f"k{i}" / "kernel.cu", tmp_path / f"k{i}" / "kernel.so", tmp_path / f"k{i}" / "build.log",
                     ("-gencode", "arch=compute_90a,code=sm_90a", "-O3"), (Path("/opt/cutlass dir/include"),))
            for i in (2, 1)]
    text = ninja_text("/usr/local/bin/nvcc", jobs)
    assert text == ninja_text("/usr/local/bin/nvcc", list(reversed(jobs)))
    assert "rule nvcc_shared" in text and "nvcc = /usr/local/bin/nvcc" in text
    assert "-o $out.$$$$.tmp $in > $log 2>&1 && mv -f $out.$$$$.tmp $out" in text
    builds = [line for line in text.splitlines() if line.startswith("build ")]
    assert builds == [f"build {tmp_path}/k1/kernel.so: nvcc_shared {tmp_path}/k1/kernel.cu",
                      f"build {tmp_path}/k2/kernel.so: nvcc_shared {tmp_path}/k2/kernel.cu"]
    assert "arch=compute_90a,code=sm_90a -O3 '-I/opt/cutlass$ dir/include'" in text
    assert f"  log = {tmp_path}/k1/build.log" in text


def test_artifact_marker_makes_corruption_a_miss(tmp_path):
    paths = ArtifactPaths(tmp_path / "k")
    paths.root.mkdir()
    assert not artifact_valid(paths, "abc")
    paths.binary.write_bytes(b"\x7fELF" + b"x" * 100)
    assert not artifact_valid(paths, "abc")                    # no marker yet: a partial entry
    publish_marker(paths, "abc", {"choice": "c"})
    assert artifact_valid(paths, "abc") and not artifact_valid(paths, "other")
    paths.binary.write_bytes(b"\x7fELF" + b"y" * 100)          # same size, different content
    assert not artifact_valid(paths, "abc")
    publish_marker(paths, "abc", {})
    paths.marker.write_text("{not json")
    assert not artifact_valid(paths, "abc")


def test_child_protocol_parsing_finds_the_culprit():
    out = "\n".join([TAG + '{"start": "a"}', TAG + '{"name": "a", "timing": {"median_ms": 1.0}}', "noise",
                     TAG + '{"start": "b"}', TAG + '{"name": "b", "error": "wrong result"}', TAG + '{"start": "c"}',
                     TAG + '{"trunc'])
    answers, in_flight = _parse(out)
    assert set(answers) == {"a", "b"} and in_flight == "c"
    assert _parse(TAG + '{"start": "a"}\n' + TAG + '{"name": "a", "error": "x"}')[1] is None


def test_isolated_child_that_cannot_start_fails_every_choice(monkeypatch):
    """Without a GPU the child dies before its first candidate: every choice gets failure text, no endless retry."""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("needs a machine without CUDA")
    from backends.isolated_child import run_isolated

    cs = [choice("cutlass2x_sm80_mm", SM80_CFG), choice("cutlass3x_sm90_mm", SM90_CFG)]
    res = run_isolated("cutlass", problem(), cs, 10.0, 120.0)
    assert set(res) == {c.name for c in cs}
    assert all(isinstance(v, str) and v.startswith("not measured: isolated child exited with status") for v in
               res.values())


# -- fused epilogues: out = act(a @ b + bias) -----------------------------------------------------------------------
EPILOGUE_CASES = [(bias, act) for bias in (False, True) for act in ("", "relu", "gelu", "silu") if bias or act]
FUNCTORS = {"relu": "cutlass::epilogue::thread::ReLu", "gelu": "cutlass::epilogue::thread::GELU_taylor",
            "silu": "cutlass::epilogue::thread::SiLu"}


def epilogue_problem(bias, act, **kw):
    return replace(problem(**kw), bias=bias, activation=act)


def epilogue_source(template, cfg, bias, act, swap=False, **kw):
    p = epilogue_problem(bias, act, **kw)
    return render(spec_for(p, choice(template, replace(cfg, swap=swap, epilogue=p.epilogue))))


def run_signature(src):
    [signature] = re.findall(r"int kernels_cutlass_run\([^)]*\)", src)
    return signature


@pytest.mark.parametrize("bias,act", EPILOGUE_CASES)
@pytest.mark.parametrize("swap", [False, True])
def test_sm90_epilogue_fusion_operation(bias, act, swap):
    src = epilogue_source("cutlass3x_sm90_mm", SM90_CFG, bias, act, swap, la="row", lb="col")
    # the bias is one value per output column: per kernel column, or per kernel row when the kernel computes C^T
    name = "LinComb" + ((f"Per{'Row' if swap else 'Col'}Bias") if bias else "") + ("EltAct" if act else "")
    args = ([FUNCTORS[act]] if act else []) + ["ElementD", "ElementCompute"] + (["ElementBias"] if bias else []) + ["void"]
    assert f"using FusionOperation = cutlass::epilogue::fusion::{name}<\n    {', '.join(args)}>;" in src
    assert "cutlass::epilogue::TmaWarpSpecializedCooperative, FusionOperation>::CollectiveOp;" in src
    formula = "A @ B + bias" if bias else "A @ B"
    assert f"// D = {f'{act}({formula})' if act else formula} with M, N, K" in src
    assert ("args.epilogue.thread.bias_ptr = static_cast<ElementBias const*>(bias);" in src) == bias
    assert run_signature(src).startswith("int kernels_cutlass_run(const void* A, const void* B, " +
                          ("const void* bias, void* D," if bias else "void* D,"))
    assert ("make_arguments(A, B, bias, D," in src) == bias
    assert "{{" not in src and "{%" not in src


@pytest.mark.parametrize("bias,act", EPILOGUE_CASES)
def test_sm80_epilogue_output_op_and_bias_operand(bias, act):
    src = epilogue_source("cutlass2x_sm80_mm", SM80_CFG, bias, act, la="row", lb="col", arch=80)
    if act:
        heavy = "false" if act == "relu" else "true"
        assert (f"LinearCombinationGeneric<{FUNCTORS[act]}, ElementD, 8, ElementAccumulator,\n        ElementCompute, "
                f"cutlass::epilogue::thread::ScaleType::Default, cutlass::FloatRoundStyle::round_to_nearest,\n"
                f"        {heavy}>," in src)
    else:
        assert "cutlass::epilogue::thread::LinearCombination<ElementD, 8, ElementAccumulator, ElementCompute>," in src
    # the bias is C with leading dimension 0 and beta = 1; without one C is not read (beta 0)
    assert ("LayoutD(0)},    // C: the bias, broadcast" in src) == bias
    assert ("{ElementCompute(1), ElementCompute(1)}" in src) == bias
    assert ("{ElementCompute(1), ElementCompute(0)}" in src) == (not bias)
    assert ("const void* bias, void* D," in run_signature(src)) == bias
    assert ("make_arguments(nullptr, nullptr, nullptr, nullptr," in src) == bias


def test_plain_sources_carry_no_epilogue():
    """The plain product's source is what it was before epilogues existed: its binaries keep their build keys."""
    for template, cfg, arch in (("cutlass3x_sm90_mm", SM90_CFG, 90), ("cutlass2x_sm80_mm", SM80_CFG, 80)):
        src = render(spec_for(problem(arch=arch), choice(template, cfg)))
        assert "bias" not in src and "Fusion" not in src and "Generic" not in src
        assert "// D = A @ B with M, N, K" in src
        assert "const void* A, const void* B, void* D," in run_signature(src)


def test_every_epilogue_is_its_own_binary_and_name():
    for template, cfg in (("cutlass3x_sm90_mm", SM90_CFG), ("cutlass2x_sm80_mm", SM80_CFG)):
        sources, names = set(), set()
        for bias, act in [(False, ""), *EPILOGUE_CASES]:
            p = epilogue_problem(bias, act)
            c = choice(template, replace(cfg, epilogue=p.epilogue))
            spec = spec_for(p, c)
            sources.add(build_key(render(spec), spec, "13.0.88", "4.2.0"))
            names.add(c.name)
            assert c.name.endswith(f"_{p.epilogue}" if p.epilogue else "_sw1" if "sm80" in template else "_sw8")
            assert CutlassConfig.from_params(c.params) == replace(cfg, epilogue=p.epilogue)
        assert len(sources) == len(names) == 1 + len(EPILOGUE_CASES)


def test_a_kernel_without_the_problems_epilogue_does_not_render():
    with pytest.raises(ValueError, match=r"fuses epilogue \(none\), the problem's is bias\+gelu"):
        spec_for(epilogue_problem(True, "gelu"), choice("cutlass3x_sm90_mm", SM90_CFG))
    with pytest.raises(ValueError, match=r"fuses epilogue relu, the problem's is \(none\)"):
        spec_for(problem(), choice("cutlass3x_sm90_mm", replace(SM90_CFG, epilogue="relu")))


def test_epilogue_problems_get_the_same_configs_carrying_the_epilogue():
    p = epilogue_problem(True, "silu", m=64, n=4096, k=4096, la="row", lb="col")
    for template in ("cutlass3x_sm90_mm", "cutlass2x_sm80_mm"):
        plain, _ = ranked_configs(replace(p, bias=False, activation=""), template)
        fused, _ = ranked_configs(p, template)
        assert fused == [replace(c, epilogue="bias+silu") for c in plain] and any(c.swap for c in fused)
        assert supports_cutlass(p, template, fused[0]) == (True, "")
        ok, why = supports_cutlass(p, template, plain[0])
        assert not ok and "epilogue (none)" in why and "bias+silu" in why
    chosen, _ = CutlassBackend(max_configs=4).choices(p)
    assert chosen and all(c.name.endswith("_bias+silu") for c in chosen)


def test_int8_leaves_epilogue_problems_out_naming_the_epilogue():
    p = epilogue_problem(True, "relu", dtype="int8", la="row", lb="col")
    chosen, skipped = CutlassBackend().choices(p)
    assert chosen == [] and set(skipped) == {"cutlass3x_sm90_int8_mm", "cutlass2x_sm80_int8_mm"}
    assert all("epilogue (bias+relu)" in why for why in skipped.values())


class _FakeKernel:
    """A LoadedKernel whose entry points record their arguments instead of launching."""

    def __init__(self):
        self.calls = []

    def workspace_size(self, m, n, k, swizzle, size):
        return 0

    def run(self, *args):
        self.calls.append(args)
        return 0


@pytest.mark.parametrize("swap", [False, True])
def test_bias_launch_passes_the_bias_after_the_operands(monkeypatch, swap):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    p = replace(problem(m=16, n=64, k=32, la="row", lb="col", arch=90), bias=True, activation="gelu")
    kernel = _FakeKernel()
    launch = make_launcher(kernel, p, replace(SM90_CFG, swap=swap, epilogue="bias+gelu"))
    a, b = torch.ones(16, 32), torch.ones(64, 32).t()
    storage = torch.zeros(80)                   # a bias whose start is not 16-byte aligned gets an aligned copy
    aligned, offset = storage[:64], storage[1:65]
    for bias in (aligned, offset):
        out = launch(a, b, bias, None)
        args = kernel.calls[-1]
        assert args[:2] == ((b.data_ptr(), a.data_ptr()) if swap else (a.data_ptr(), b.data_ptr()))
        assert args[3] == out.data_ptr() and args[4:6] == ((64, 16) if swap else (16, 64))
        assert (args[2] == bias.data_ptr()) == (bias is aligned) and args[2] % 16 == 0
    out = torch.empty(16, 64)
    assert launch(a, b, aligned, out) is out and kernel.calls[-1][3] == out.data_ptr()
    plain = make_launcher(kernel, replace(p, bias=False, activation=""), replace(SM90_CFG, swap=swap))
    plain(a, b)
    assert len(kernel.calls[-1]) == len(args) - 1       # no bias pointer in the plain entry point


def test_a_batch_hoists_the_includes_and_renames_each_members_entry_points():
    from backends.cutlass_render import ENTRY_POINTS, batch_source, symbol_suffix

    a = ('#include "cutlass/cutlass.h"\nnamespace { int helper; }\n'
         'extern "C" { int kernels_cutlass_run() { return 1; } }\n')
    b = '#include "cutlass/cutlass.h"\n#include <cstdint>\nnamespace { int helper; }\n'
    src = batch_source([(a, symbol_suffix("0123456789abcdef99")), (b, "_x")])
    assert src.count('#include "cutlass/cutlass.h"') == 1 and "#include <cstdint>" in src
    assert src.index("#include <cstdint>") < src.index("namespace kernels_batch_0")
    for name in ENTRY_POINTS:
        assert f"#define {name} {name}_0123456789abcdef\n" in src and f"#define {name} {name}_x\n" in src
    assert src.count("namespace kernels_batch_") == 4       # each body opened and closed in its own namespace


def test_translation_units_fill_the_compile_slots_once():
    from types import SimpleNamespace

    from backends.cutlass import MAX_UNIT_KERNELS, translation_units

    def jobs(n, flags=("-a",)):
        return [SimpleNamespace(spec=SimpleNamespace(flags=flags), i=i) for i in range(n)]
    assert [len(u) for u in translation_units(jobs(12), 16)] == [1] * 12          # they fit: one kernel a unit
    assert [len(u) for u in translation_units(jobs(31), 16)] == [2] * 15 + [1]    # the bf16 set: one wave
    assert max(len(u) for u in translation_units(jobs(100), 2)) == MAX_UNIT_KERNELS
    assert [len(u) for u in translation_units(jobs(12), 2, most=4)] == [3] * 4   # two full waves, not 4+4 then 4
    mixed = translation_units(jobs(3, ("-x",)) + jobs(3, ("-y",)), 3)
    assert all(len({m.spec.flags for m in u}) == 1 for u in mixed)                 # flags never mix in a unit
