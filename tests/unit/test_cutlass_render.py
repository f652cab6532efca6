"""Pure parts of the CUTLASS build: rendering each family, flags, artifact keys, the ninja file, artifact markers,
and the isolated child's protocol parsing."""
import re
from pathlib import Path

from backends.cutlass import ArtifactPaths, artifact_valid, publish_marker
from backends.isolated_child import TAG, _parse
from backends.cutlass_render import BuildJob, build_key, ninja_text, render, spec_for
from kernels.core.choice import Choice
from kernels.space.heuristics_cutlass import CutlassConfig
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
