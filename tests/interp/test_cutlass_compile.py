"""Compile-only with nvcc: one sm80 config through the backend's ninja path (no GPU needed), per arch two fused
epilogues (bias+gelu, silu without bias; the sm90 pair in one ninja batch, whose bf16 kernels also stand for the plain
sm90 bf16 build's HGMMA check), and two fp8 scaled kernels (per-tensor; row-wise + bias, swapped) built in one ninja
batch. A plain sm90 kernel is built by tests/interp/test_bench_cutlass_compile_only.py.
An sm90 file takes ~90-100 s and ~3 GB on 2 cores, an sm80 one ~18 s: keep this set small, and batch the sm90 ones
two at a time. The fp8 pair takes ~2 min (both at once, ~3.5 GB each): the epilogue visitor tree is heavier than mm's
named fusion operations."""
import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from backends.cutlass import ArtifactPaths, CutlassBackend, load_library, run_ninja
from backends.cutlass_render import BuildJob, render, spec_for
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.space.heuristics_cutlass import CutlassConfig, fit_alignment, supports_cutlass
from kernels.core.toolchain import resolve
from tests.helpers import REPO, problem

TOOLS = resolve()
needs_toolchain = pytest.mark.skipif(not TOOLS.usable or shutil.which("ninja") is None,
                                     reason=f"nvcc/CUTLASS/ninja missing: {TOOLS.message or 'ninja not on PATH'}")
pytestmark = [pytest.mark.slow, needs_toolchain]


def cuobjdump() -> str | None:
    candidates = [shutil.which("cuobjdump")]
    if TOOLS.nvcc is not None:
        candidates.append(str(TOOLS.nvcc.parent / "cuobjdump"))
    try:
        import triton

        candidates.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def build_one(tmp_path: Path, p, template: str, cfg: CutlassConfig) -> ArtifactPaths:
    paths = build_batch(tmp_path, {0: spec_for(p, Choice("cutlass", template, p.dtype, None, cfg.params()))})[0]
    assert paths.binary.exists(), paths.log.read_text()[-3000:]
    assert not glob.glob(str(paths.root / "*.tmp")), "a temp binary was left behind"
    lib = ctypes.CDLL(str(paths.binary))
    assert lib.kernels_cutlass_run and lib.kernels_cutlass_workspace_size
    return paths


def test_compile_sm80_int8(tmp_path):
    cfg = CutlassConfig(64, 64, 128, schedule="", stages=4, warps_m=2, warps_n=2, align=16, align_c=4)
    paths = build_one(tmp_path, problem(256, 256, 256, dtype="int8", la="row", lb="col", arch=80),
                      "cutlass2x_sm80_int8_mm", cfg)
    tool = cuobjdump()
    if tool:
        sass = subprocess.run([tool, "--dump-sass", str(paths.binary)], capture_output=True, text=True).stdout
        assert "IMMA" in sass


EPILOGUE_BUILDS = [
    # sm90: the bias per kernel column (LinCombPerColBiasEltAct); silu alone swapped (LinCombEltAct, column-major D)
    ("cutlass3x_sm90_mm", 90, True, "gelu", CutlassConfig(128, 128, 64, 1, 1, "coop", align=8, align_c=8)),
    ("cutlass3x_sm90_mm", 90, False, "silu",
     CutlassConfig(64, 128, 64, 1, 1, "pingpong", swap=True, align=8, align_c=8)),
    # sm80: the bias as C with leading dimension 0 (row-major D); silu alone swapped (column-major D)
    ("cutlass2x_sm80_mm", 80, True, "gelu",
     CutlassConfig(128, 128, 64, schedule="", stages=4, warps_m=2, warps_n=2, align=8, align_c=8)),
    ("cutlass2x_sm80_mm", 80, False, "silu",
     CutlassConfig(64, 64, 64, schedule="", stages=5, warps_m=2, warps_n=2, swap=True, align=8, align_c=8)),
]
# what each activation leaves in the SASS, which a plain product has none of: GELU_taylor's tanh.approx, SiLu's exp
ACTIVATION_SASS = {"gelu": "MUFU.TANH", "silu": "MUFU.EX2"}


def epilogue_problem(arch, bias, act, cfg):
    return replace(problem(64 if cfg.swap else 1024, 1024, 1024, dtype="fp16" if arch == 80 else "bf16", la="row",
                           lb="col", arch=arch), bias=bias, activation=act)


def build_batch(root: Path, specs: dict[int, object]) -> dict[int, ArtifactPaths]:
    """Render each spec under `root`/kernel<i> and compile them all in one ninja batch, two at a time (two cores):
    index -> ArtifactPaths."""
    jobs, built = [], {}
    for i, spec in specs.items():
        paths = ArtifactPaths(root / f"kernel{i}")
        paths.root.mkdir()
        paths.source.write_text(render(spec))
        jobs.append(BuildJob(paths.source, paths.binary, paths.log, spec.flags, TOOLS.cutlass.include_dirs))
        built[i] = paths
    run_ninja(str(TOOLS.nvcc), jobs, root / "batches", 2)
    return built


@pytest.fixture(scope="module")
def sm90_epilogue_binaries(tmp_path_factory):
    """The sm90 epilogue builds in one batch: index -> ArtifactPaths."""
    specs = {}
    for i, (template, arch, bias, act, cfg) in enumerate(EPILOGUE_BUILDS):
        if arch == 90:
            p = epilogue_problem(arch, bias, act, cfg)
            specs[i] = spec_for(p, Choice("cutlass", template, p.dtype, None,
                                          replace(cfg, epilogue=p.epilogue).params()))
    return build_batch(tmp_path_factory.mktemp("sm90_epilogues"), specs)


@pytest.mark.parametrize("index", range(len(EPILOGUE_BUILDS)),
                         ids=[f"sm{e[1]}-{'bias+' if e[2] else ''}{e[3]}" for e in EPILOGUE_BUILDS])
def test_compile_fused_epilogue(tmp_path, request, index):
    template, arch, bias, act, cfg = EPILOGUE_BUILDS[index]
    p = epilogue_problem(arch, bias, act, cfg)
    if arch == 90:
        paths = request.getfixturevalue("sm90_epilogue_binaries")[index]
        assert paths.binary.exists(), paths.log.read_text()[-3000:]
        assert not glob.glob(str(paths.root / "*.tmp")), "a temp binary was left behind"
    else:
        paths = build_one(tmp_path, p, template, replace(cfg, epilogue=p.epilogue))
    kernel = load_library(paths.binary, p.epilogue_operands)    # the run entry point takes the bias pointer after B
    size = ctypes.c_size_t(1)
    assert kernel.workspace_size(p.m, p.n, p.k, 1, ctypes.byref(size)) == 0
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to inspect the SASS")
    sass = subprocess.run([tool, "--dump-sass", str(paths.binary)], capture_output=True, text=True).stdout
    assert ACTIVATION_SASS[act] in sass and ("HGMMA" if arch == 90 else "HMMA") in sass
    if arch == 90:                                              # the bf16 warpgroup MMA, not only a bf16 store
        assert re.search(r"HGMMA\.\w+\.F32\.BF16", sass), "no bf16 wgmma"


def test_failed_compile_keeps_source_and_log(tmp_path, monkeypatch):
    """A source that does not compile: the failure text points at the saved source and compiler log."""
    import backends.cutlass as cutlass_mod

    monkeypatch.setattr(cutlass_mod, "render", lambda spec: "#error deliberately broken\n")
    config.cutlass_build = "inline"        # compiled in the build (the default leaves it to the background build)
    backend = CutlassBackend(TOOLS)
    c = Choice("cutlass", "cutlass2x_sm80_mm", "bf16", None,
               CutlassConfig(64, 64, 64, schedule="", stages=3, warps_m=2, warps_n=2, align=8, align_c=8).params())
    [outcome] = backend.build(problem(arch=80), [c])
    assert outcome.runner is None and outcome.compiled
    assert "deliberately broken" in outcome.error
    src = outcome.error.split("(source ")[1].split(",")[0]
    log = outcome.error.split("log ")[-1].rstrip(")")
    assert Path(src).read_text() == "#error deliberately broken\n" and "deliberately broken" in Path(log).read_text()
    assert not (Path(src).parent / "meta.json").exists()


def test_run_time_twins_share_one_build(tmp_path, monkeypatch):
    """sm90 choices differing only in swizzle (a run-time argument) map to one artifact and one ninja edge."""
    import backends.cutlass as cutlass_mod

    monkeypatch.setattr(cutlass_mod, "render", lambda spec: "#error twin\n")
    config.cutlass_build = "inline"
    cfg = CutlassConfig(128, 128, 64, 1, 1, "coop", align=8, align_c=8)
    twins = [Choice("cutlass", "cutlass3x_sm90_mm", "bf16", None, c.params()) for c in (cfg, replace(cfg, swizzle=8))]
    outcomes = CutlassBackend(TOOLS).build(problem(), twins)
    assert [o.runner for o in outcomes] == [None, None]
    assert all("#error twin" in o.error and "(no compiler log)" not in o.error for o in outcomes)
    assert outcomes[0].error == outcomes[1].error


def test_warmup_builds_a_one_kernel_set_with_nvcc(tmp_path):
    """`python -m kernels warmup` end to end with the real compiler: the sm80 int8 set narrowed (KERNELS_ONLY, the
    tuner's own narrowing) to one kernel; a second run builds nothing."""
    env = dict(os.environ, KERNELS_CACHE_DIR=str(tmp_path / "cache"), KERNELS_ONLY="int8_mm_64x64x128",
               PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "kernels", "warmup", "--arch", "80", "--dtypes", "int8", "--jobs", "2"]
    first = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "int8 1 kernels (0 built); building 1" in first.stdout
    assert "int8 1 kernels (1 built); compiled 1" in first.stdout
    second = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert second.returncode == 0 and "building 0" in second.stdout, second.stdout + second.stderr
    [library] = (tmp_path / "cache" / "cutlass" / "sm80").glob("*/kernel.so")
    assert ctypes.CDLL(str(library)).kernels_cutlass_run


# fp8 (cutlass3x_sm90_scaled_mm), (scaling, bias, A dtype, out dtype, M, config): per-tensor scales (one
# ScalarBroadcast of both), e4m3 x e4m3 -> bf16 on a cooperative 2x1 cluster; row-wise scales and a bias on a swapped
# pingpong kernel (C^T: scale_a a kernel row vector, scale_b and the bias column vectors), e5m2 x e4m3 -> fp16
SCALED_BUILDS = [
    ("tensor", False, "e4m3", "bf16", 4096, CutlassConfig(128, 128, 128, 2, 1, "coop")),
    ("row", True, "e5m2", "fp16", 17, CutlassConfig(64, 128, 128, 1, 1, "pingpong", swap=True)),
]


def scaled_problem(scaling, bias, dtype, out, m):
    return replace(problem(m, 4096, 4096 + 16, dtype=dtype, op="scaled_mm", la="row", lb="col"), out_dtype=out,
                   scaling=scaling, bias=bias)


@pytest.fixture(scope="module")
def scaled_binaries(tmp_path_factory):
    """Both fp8 kernels compiled in one ninja batch (two compiles at once on two cores): index -> ArtifactPaths."""
    specs = {}
    for i, (scaling, bias, dtype, out, m, cfg) in enumerate(SCALED_BUILDS):
        p = scaled_problem(scaling, bias, dtype, out, m)
        cfg = fit_alignment(p, "cutlass3x_sm90_scaled_mm", cfg)
        assert supports_cutlass(p, "cutlass3x_sm90_scaled_mm", cfg) == (True, "")
        specs[i] = spec_for(p, Choice("cutlass", "cutlass3x_sm90_scaled_mm", dtype, None, cfg.params()))
    return build_batch(tmp_path_factory.mktemp("scaled"), specs)


@pytest.mark.parametrize("index", range(len(SCALED_BUILDS)),
                         ids=[f"{b[0]}{'+bias' if b[1] else ''}-{b[2]}-{b[3]}{'-swap' if b[5].swap else ''}"
                              for b in SCALED_BUILDS])
def test_compile_scaled_fp8(scaled_binaries, index):
    scaling, bias, dtype, out, m, cfg = SCALED_BUILDS[index]
    paths = scaled_binaries[index]
    assert paths.binary.exists(), paths.log.read_text()[-3000:]
    p = scaled_problem(scaling, bias, dtype, out, m)
    kernel = load_library(paths.binary, p.epilogue_operands)     # A, B, scale_a, scale_b[, bias], D, ...
    assert len(kernel.run.argtypes) == 3 + p.epilogue_operands + 9
    size = ctypes.c_size_t(1)
    assert kernel.workspace_size(p.n if cfg.swap else p.m, p.m if cfg.swap else p.n, p.k, 1, ctypes.byref(size)) == 0
    assert size.value == 0                                        # no stream-K: no workspace
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to inspect the SASS")
    sass = subprocess.run([tool, "--dump-sass", str(paths.binary)], capture_output=True, text=True).stdout
    # the fp8 wgmma, QGMMA, with the kernel's A then B type (swapped: the problem's B is the kernel's A)
    kernel_a, kernel_b = ("e4m3", dtype) if cfg.swap else (dtype, "e4m3")
    assert re.search(rf"QGMMA\.\w+\.F32\.{kernel_a.upper()}\.{kernel_b.upper()}", sass), "no fp8 wgmma"


SM80_PAIR = (CutlassConfig(128, 128, 64, schedule="", stages=4, warps_m=2, warps_n=2, align=8, align_c=8),
             CutlassConfig(64, 64, 64, schedule="", stages=5, warps_m=2, warps_n=2, align=8, align_c=8))


def _sm80_choices():
    p = problem(1024, 1024, 1024, dtype="fp16", la="row", lb="col", arch=80)
    return p, [Choice("cutlass", "cutlass2x_sm80_mm", "fp16", None, c.params()) for c in SM80_PAIR]


def test_kernels_beyond_the_parallel_compiles_share_a_translation_unit(isolated_cache):
    """Two kernels, one compile slot: one nvcc run builds both (the headers parsed once); each gets its own binary
    (the unit's, hard-linked), valid under its own key, loaded by its suffixed entry points."""
    from backends.cutlass import artifact_valid
    from backends.cutlass_render import symbol_suffix

    backend = CutlassBackend()
    p, choices = _sm80_choices()
    assert backend.prebuild([(p, choices)], max_jobs=1) == 2
    units = backend.root / "batches" / "units"
    assert not list(units.iterdir())          # the unit's .so went to its members; its source and log are removed
    inodes = set()
    for c in choices:
        key, paths, _ = backend.artifact_paths(p, c)
        assert artifact_valid(paths, key), paths.log.read_text()[-2000:]
        lib = ctypes.CDLL(str(paths.binary))
        assert hasattr(lib, "kernels_cutlass_run" + symbol_suffix(key)) and not hasattr(lib, "kernels_cutlass_run")
        kernel = load_library(paths.binary, 0, symbol_suffix(key))
        size = ctypes.c_size_t(1)
        assert kernel.workspace_size(p.m, p.n, p.k, 1, ctypes.byref(size)) == 0
        inodes.add(paths.binary.stat().st_ino)
    assert len(inodes) == 1
    assert [backend.state(p, c) for c in choices] == ["built", "built"]
    assert backend.prebuild([(p, choices)], max_jobs=1) == 0          # nothing to compile again


def test_a_unit_that_fails_is_compiled_again_one_kernel_at_a_time(isolated_cache, monkeypatch):
    """One config that does not compile must not cost the others sharing its unit their binaries."""
    import backends.cutlass as cutlass_backend

    p, choices = _sm80_choices()
    real = cutlass_backend.render
    broken = spec_for(p, choices[1])
    monkeypatch.setattr(cutlass_backend, "render",
                        lambda spec: real(spec) + ("\n#error broken on purpose\n" if spec == broken else ""))
    backend = CutlassBackend()
    backend.prebuild([(p, choices)], max_jobs=1)
    states = [backend.state(p, c) for c in choices]
    assert states == ["built", "failed"]
    key, paths, _ = backend.artifact_paths(p, choices[1])
    assert "broken on purpose" in paths.log.read_text()
