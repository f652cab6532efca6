"""Compile every Triton template for sm90 without a GPU, through the real worker pool, and read the SASS.

The workers never see TRITON_INTERPRET, so this runs from the interpreter-mode test process too."""
import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import triton

from backends.triton import TritonBackend
from backends.triton_modules import module_file_name
from backends.triton_render import render
from backends.triton_templates import family
from kernels.core.choice import Choice
from kernels.core.fsutil import write_if_different
from kernels.space.heuristics import GemmConfig
from tests.helpers import problem

pytestmark = pytest.mark.slow


def cuobjdump() -> str | None:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def compile_jobs(backend, cases):
    jobs = []
    for i, (p, choice) in enumerate(cases):
        for j, spec in enumerate(family(choice.template).specs(p, choice)):
            source = render(spec)
            path = backend.root / "src" / module_file_name(f"{choice.name}_{i}_{j}", source)   # workers check it
            write_if_different(path, source)
            job = backend._job(p, spec, path)
            job["id"] = len(jobs)
            jobs.append(job)
    results = backend._get_pool().map(jobs, timeout_s=600)
    return [dict(r, kernel=job["kernel_name"]) for r, job in zip(results, jobs)]


def test_templates_compile_for_sm90_with_wgmma():
    backend = TritonBackend()
    cfg = GemmConfig(128, 128, 64, 3, 4)
    cases = [(problem(dtype="bf16"), Choice("triton", "triton_mm", "bf16", cfg)),
             (problem(dtype="fp16", stride_b=(1, 4096)), Choice("triton", "triton_mm", "fp16", cfg)),
             (problem(dtype="int8", op="int_mm", stride_b=(1, 4096)), Choice("triton", "triton_int8_mm", "int8", cfg)),
             (problem(m=100, n=50, k=70, dtype="bf16"), Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 32, 2, 4))),
             (problem(m=64, n=64, k=8192, dtype="bf16"),
              Choice("triton", "split_k", "bf16", GemmConfig(64, 64, 64, 4, 4), (("split", 16),))),
             (problem(m=64, n=64, k=8192, dtype="int8", op="int_mm", stride_b=(1, 8192)),
              Choice("triton", "split_k", "int8", GemmConfig(64, 64, 64, 4, 4), (("split", 16),))),
             (problem(m=64, n=64, k=8192, dtype="bf16"), Choice("triton", "decompose_k", "bf16", None, (("split", 8),))),
             (problem(dtype="bf16"), Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8),
                                            (("sub", 1),))),
             (problem(dtype="int8", op="int_mm", stride_b=(1, 4096)),
              Choice("triton", "triton_tma_int8_mm", "int8", GemmConfig(128, 128, 128, 3, 8))),
             (problem(m=2047, n=2047, k=2047, dtype="bf16"),
              Choice("triton", "triton_padded_mm", "bf16", GemmConfig(128, 128, 64, 3, 8))),
             (problem(m=2047, n=2047, k=2047, dtype="bf16"),
              Choice("triton", "triton_padded_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))),
             (problem(m=2047, n=2047, k=2047, dtype="bf16"),
              Choice("triton", "triton_padded_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8))),
             (problem(m=2047, n=2047, k=2047, dtype="int8", op="int_mm"),
              Choice("triton", "triton_padded_tma_int8_mm", "int8", GemmConfig(128, 256, 128, 3, 8))),
             (problem(m=2047, n=2047, k=2047, dtype="int8", op="int_mm"),
              Choice("triton", "triton_padded_int8_mm", "int8", GemmConfig(128, 256, 128, 3, 8))),
             (problem(dtype="int8", op="int_mm"),
              Choice("triton", "triton_kmajor_int8_mm", "int8", GemmConfig(128, 256, 128, 3, 8)))]
    try:
        results = compile_jobs(backend, cases)
    finally:
        backend.close()
    assert all(r["ok"] for r in results), [r.get("error") for r in results]
    tool = cuobjdump()
    for r in results:
        if r["kernel"].endswith(("_reduce", "_pad", "_bt")):
            continue        # decompose_k's reduction and the padding / transposing copies have no dot
        group = backend.triton_cache_dir / r["cache_group"]
        cubins = list(group.glob("*.cubin"))
        meta = json.loads(next(p for p in group.glob("*.json") if not p.name.startswith("__grp__")).read_text())
        assert cubins and meta["target"]["arch"] == 90
        if tool:
            sass = subprocess.run([tool, "--dump-sass", str(cubins[0])], capture_output=True, text=True).stdout
            assert "HGMMA" in sass or "IGMMA" in sass, "expected Hopper wgmma instructions in the SASS"
            if r["kernel"].startswith(("triton_kmajor_int8_mm", "triton_padded_int8_mm", "triton_padded_tma_int8_mm")):
                # their B copies are K-major so that no tile is transposed in registers (byte permutes)
                assert "PRMT" not in sass, r["kernel"]


def sass_of(backend, result) -> str:
    cubin = next((backend.triton_cache_dir / result["cache_group"]).glob("*.cubin"))
    return subprocess.run([cuobjdump(), "--dump-sass", str(cubin)], capture_output=True, text=True).stdout


def test_every_family_compiles_with_a_fused_epilogue_for_sm90():
    """bf16 bias + activation in every family that serves mm; the epilogue kernel (the last of a choice) holds the
    activation's exp (MUFU.EX2) or max, the others none of it."""
    backend = TritonBackend()
    cfg = GemmConfig(128, 128, 64, 3, 4)

    def epi(p, activation):
        return dataclasses.replace(p, bias=True, activation=activation)

    odd = problem(m=2047, n=2047, k=2047, dtype="bf16")
    col_b = problem(m=512, n=1024, k=4096, dtype="bf16", stride_b=(1, 4096))           # nn.Linear's weight.t()
    cases = [(epi(col_b, "gelu"), Choice("triton", "triton_mm", "bf16", cfg)),
             (epi(col_b, "silu"), Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8),
                                         (("sub", 1),))),
             (epi(problem(dtype="bf16"), "relu"), Choice("triton", "triton_tma_mm", "bf16", cfg)),
             (epi(problem(m=64, n=64, k=8192, dtype="bf16"), "silu"),
              Choice("triton", "split_k", "bf16", GemmConfig(64, 64, 64, 4, 4), (("split", 16),))),
             (epi(problem(m=64, n=64, k=8192, dtype="bf16"), "gelu"),
              Choice("triton", "decompose_k", "bf16", None, (("split", 8),))),
             (epi(odd, "silu"), Choice("triton", "triton_padded_mm", "bf16", cfg)),
             (epi(odd, "gelu"), Choice("triton", "triton_padded_tma_mm", "bf16", GemmConfig(128, 256, 64, 3, 8)))]
    try:
        results = compile_jobs(backend, cases)
    finally:
        backend.close()
    assert all(r["ok"] for r in results), [r.get("error") for r in results]
    if not cuobjdump():
        return
    kernels = iter(results)
    for p, choice in cases:
        specs = family(choice.template).specs(p, choice)
        for i, spec in enumerate(specs):
            sass, last = sass_of(backend, next(kernels)), i == len(specs) - 1
            assert ("MUFU.EX2" in sass) == (last and p.activation != "relu"), spec.kernel_name
            if last and p.activation == "relu":
                # relu as a select on an unordered compare (NaN >= 0 holds): it keeps NaN, as FMNMX would not
                assert "FSETP.GEU" in sass and "FSEL" in sass, spec.kernel_name
            if not spec.kernel_name.endswith(("_reduce", "_pad")):
                assert "HGMMA" in sass, spec.kernel_name


def test_compile_failure_is_reported_not_raised(tmp_path):
    backend = TritonBackend()
    source = "import triton\n@triton.jit\ndef k(a_ptr):\n    undefined_name(a_ptr)\n"
    bad = tmp_path / module_file_name("bad", source)
    bad.write_text(source)
    job = {"id": 0, "module_path": str(bad), "kernel_name": "k", "signature": {"a_ptr": "*fp16"}, "div16": [],
           "backend": "cuda", "arch": 90, "warp_size": 32, "options": {"num_warps": 4, "num_stages": 2}}
    try:
        (res,) = backend._get_pool().map([job], timeout_s=300)
    finally:
        backend.close()
    assert not res["ok"] and "undefined_name" in res["error"]


def test_built_names_what_the_artifact_store_holds(tmp_path, monkeypatch):
    """After a build compiles a choice for sm90 (its load fails here: no GPU), `built` names it and not a sibling."""
    import backends.triton as triton_backend
    from kernels import config

    config.cache_dir = str(tmp_path)
    monkeypatch.setattr(triton_backend, "interpret_mode", lambda: False)
    backend = TritonBackend()
    p = problem(m=256, n=256, k=256, dtype="bf16")
    done, other = (Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 32, s, 4)) for s in (2, 3))
    try:
        assert backend.built(p, [done, other]) == set()
        (outcome,) = backend.build(p, [done])
    finally:
        backend.close()
    assert outcome.compiled and "load failed" in (outcome.error or "")
    assert backend.built(p, [done, other]) == {done.name}


def test_a_stored_kernel_loads_from_its_checked_folder_as_tritons_cache_hit_would(tmp_path, monkeypatch):
    """What build() compiled and recorded, _from_store rebuilds as the CompiledKernel triton.compile returns on a
    cache hit (same binary, name, hash and metadata), without computing Triton's cache key; a record for another
    kernel, or one naming a file outside its folder, gives None (then triton.compile is asked)."""
    import backends.triton as triton_backend
    from kernels import config

    config.cache_dir = str(tmp_path)
    monkeypatch.setattr(triton_backend, "interpret_mode", lambda: False)
    backend = TritonBackend()
    p = problem(m=256, n=256, k=256, dtype="bf16")
    choice = Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 32, 2, 4))
    try:
        backend.build(p, [choice])
    finally:
        backend.close()
    (spec,) = family(choice.template).specs(p, choice)
    records = list((backend.root / "artifacts").glob("*.json"))
    assert len(records) == 1
    key, meta = records[0].stem, json.loads(records[0].read_text())
    module = next((backend.root / "src").glob("*.py"))
    kernel = backend._from_store(p, spec, module, key)
    group = backend.triton_cache_dir / meta["cache_group"]
    assert kernel is not None and kernel.hash == meta["triton_hash"] and kernel.name == spec.kernel_name
    assert kernel.asm["cubin"] == next(group.glob("*.cubin")).read_bytes()
    assert kernel.metadata.target.arch == 90 and kernel.metadata.num_warps == 4
    assert backend._from_store(p, dataclasses.replace(spec, kernel_name="another"), module, key) is None
    # a record rewritten since it was checked, naming a file outside its folder: None, nothing read from there
    records[0].write_text(json.dumps(dict(meta, files={"../../elsewhere.cubin": "0" * 64})))
    assert backend._from_store(p, spec, module, key) is None


def test_fp8_families_compile_for_sm90_with_fp8_wgmma():
    """Every family serving scaled_mm, both scalings, a bias, e5m2 x e4m3: Hopper's fp8 warpgroup MMA (QGMMA) in
    the SASS of tiles with at least 64 rows (a warpgroup's MMA); Triton runs thinner tiles (split_k's 16-row ones,
    for skinny, memory-bound problems) as mma.sync on values converted to fp16 (HMMA)."""
    backend = TritonBackend()

    def fp8(m, n, k, scaling, bias=False, dtype="e4m3", out_dtype="bf16"):
        p = problem(m=m, n=n, k=k, dtype=dtype, op="scaled_mm", lb="col")
        return dataclasses.replace(p, out_dtype=out_dtype, scaling=scaling, bias=bias)

    cases = [(fp8(4096, 4096, 4096, "tensor"),
              Choice("triton", "triton_scaled_mm", "e4m3", GemmConfig(128, 128, 128, 4, 8))),
             (fp8(4096, 4096, 4096, "row", bias=True),
              Choice("triton", "triton_tma_scaled_mm", "e4m3", GemmConfig(128, 256, 128, 3, 8), (("sub", 1),))),
             (fp8(16, 12288, 4096, "row", out_dtype="fp16"),
              Choice("triton", "split_k", "e4m3", GemmConfig(16, 128, 128, 4, 4), (("split", 4),))),
             (fp8(64, 4096, 11008, "tensor", dtype="e5m2", out_dtype="fp32"),
              Choice("triton", "triton_tma_scaled_mm", "e5m2", GemmConfig(128, 128, 128, 4, 8)))]
    try:
        results = compile_jobs(backend, cases)
    finally:
        backend.close()
    assert all(r["ok"] for r in results), [r.get("error") for r in results]
    if not cuobjdump():
        return
    for (p, choice), r in zip(cases, results):
        sass = sass_of(backend, r)
        assert ("QGMMA" if choice.config.block_m >= 64 else "HMMA") in sass, r["kernel"]
