"""GPU: every default CUTLASS choice vs torch over ragged shapes and layouts, isolation of a faulting kernel,
shape-agnostic binaries, CUTLASS inside kernels.mm, and the fp8 family (cutlass3x_sm90_scaled_mm) against the
float64 reference and inside kernels.scaled_mm. Run on the device: `pytest -m gpu tests/gpu/test_cutlass.py`.

Binaries are shared across the tests of this module (one artifact cache dir), so each is compiled once. `pytest -m
gpu` (one device call, <= 5 min on the H100) keeps only what builds nothing: the layouts int8 excludes; `pytest -m gpu_sweep` builds every default choice over the shapes and layouts
(about 125 binaries: CUTLASS's nvcc builds took over 3 min of the H100's 16 cores for the 41 the gpu set used to hold)."""
import os
import re
import subprocess

import pytest
import torch

import kernels
from backends import get_backend
from backends.cutlass import publish_marker
from kernels.core.problem import DTYPES_BY_NAME, GemmProblem
from kernels.measure.timing import Timing
from kernels.measure.verify import make_inputs, reference
from tests.helpers import gpu_grid

@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cutlass_gpu_cache")


@pytest.fixture
def backend(shared_cache):
    kernels.config.cache_dir = str(shared_cache)      # after conftest's per-test reset
    kernels.config.cutlass_build = "inline"           # these test the builds themselves, not the background build
    b = get_backend("cutlass")
    probe = GemmProblem.from_tensors("mm", *_operands(128, 128, 128, "row", "row", torch.bfloat16))
    ok, why = b.available(probe)
    if not ok:
        pytest.skip(f"CUTLASS backend unavailable: {why}")
    return b


def _operand(rows, cols, layout, dtype):
    def rand(r, c):
        if dtype == torch.int8:
            return torch.randint(-128, 128, (r, c), dtype=torch.int8, device="cuda")
        return torch.randn(r, c, device="cuda").to(dtype)
    return rand(rows, cols) if layout == "row" else rand(cols, rows).t()


def _operands(m, n, k, la, lb, dtype):
    return _operand(m, k, la, dtype), _operand(k, n, lb, dtype)


def _rel_err(c, ref):
    ref = ref.double()
    return float((c.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _check_every_choice(backend, op, a, b):
    problem = GemmProblem.from_tensors(op, a, b)
    chosen, skipped = backend.choices(problem)
    assert chosen, f"no CUTLASS choice for {problem.short()}: {skipped}"
    outcomes = backend.build(problem, chosen)
    failed = {o.choice.name: o.error for o in outcomes if o.runner is None}
    assert not failed, failed
    runners = [o.runner for o in outcomes]
    assert all(r.isolated for r in runners)
    # first in the child (verify + time with kernels.verify / kernels.timing): a fault here cannot hurt us
    measured = backend.measure_isolated(problem, runners, 5.0)
    bad = {n: r for n, r in measured.items() if not isinstance(r, Timing)}
    assert not bad, bad
    # then in this process, against aten itself
    if op == "mm":
        ref = torch.mm(a, b)
    else:
        ref = torch._int_mm(a, b) if problem.m > 16 and problem.k % 8 == 0 and problem.n % 8 == 0 else \
            (a.double() @ b.double()).to(torch.int32)
    for r in runners:
        out = r.launch(a, b, None)
        torch.cuda.synchronize()
        assert out.shape == ref.shape and out.dtype == ref.dtype, r.choice.name
        if op == "mm":
            assert _rel_err(out, a.double() @ b.double()) < 1e-2, r.choice.name
        else:
            assert torch.equal(out, ref), r.choice.name
    # a preallocated, strided `out` goes through the staging copy
    wide = torch.empty(problem.m, problem.n + 3, dtype=ref.dtype, device="cuda")
    out = wide[:, :problem.n]
    runners[0].launch(a, b, out)
    torch.cuda.synchronize()
    if op == "mm":
        assert _rel_err(out, a.double() @ b.double()) < 1e-2
    else:
        assert torch.equal(out, ref)
    return problem, chosen


MM_CASES = [  # (m, n, k, layout a, layout b): big, ragged-but-aligned, small M (swap), odd N (sm80 narrow)
    (4096, 4096, 4096, "row", "row"),
    (1000, 3000, 520, "row", "row"),
    (1000, 3000, 520, "col", "col"),
    (129, 200, 72, "row", "col"),
    (16, 4096, 4096, "row", "row"),
    (77, 1001, 130, "row", "col"),
]
# fp16 shares bf16's code paths: its ragged shape alone keeps compiles down
MM_GRID = [(torch.bfloat16, *case) for case in MM_CASES] + \
    [(torch.float16, *case) for case in MM_CASES if case[:3] == (1000, 3000, 520)]
INT8_GRID = [(4096, 4096, 4096), (1024, 22016, 4096), (33, 1000, 4112), (17, 4096, 4096)]


@pytest.mark.parametrize("dtype,m,n,k,la,lb", gpu_grid(MM_GRID, []))
def test_every_default_mm_choice_matches_torch(backend, dtype, m, n, k, la, lb):
    _check_every_choice(backend, "mm", *_operands(m, n, k, la, lb, dtype))


@pytest.mark.parametrize("m,n,k", gpu_grid(INT8_GRID, []))
def test_every_default_int8_choice_matches_int_mm(backend, m, n, k):
    _check_every_choice(backend, "int_mm", *_operands(m, n, k, "row", "col", torch.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("la,lb", [("row", "row"), ("col", "col"), ("col", "row")])
def test_int8_other_layouts_are_excluded_not_attempted(backend, la, lb):
    a, b = _operands(256, 256, 256, la, lb, torch.int8)
    chosen, skipped = backend.choices(GemmProblem.from_tensors("int_mm", a, b))
    assert chosen == [] and all("A row-major and B column-major" in why for why in skipped.values())


@pytest.mark.gpu_sweep
def test_second_shape_compiles_nothing(backend):
    a, b = _operands(2048, 2048, 2048, "row", "row", torch.bfloat16)
    p1 = GemmProblem.from_tensors("mm", a, b)
    chosen, _ = backend.choices(p1)
    backend.build(p1, chosen)
    a2, b2 = _operands(1536, 3072, 1024, "row", "row", torch.bfloat16)
    p2 = GemmProblem.from_tensors("mm", a2, b2)
    outcomes = backend.build(p2, chosen)
    assert all(o.runner is not None and not o.compiled for o in outcomes), [o.error for o in outcomes]
    for o in outcomes:
        assert _rel_err(o.runner.launch(a2, b2, None), a2.double() @ b2.double()) < 1e-2


FAULT_SOURCE = r"""
#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>
__global__ void poke(int* p) { p[threadIdx.x] = 1; }
extern "C" int kernels_cutlass_workspace_size(int, int, int, int, size_t* bytes) { *bytes = 0; return 0; }
extern "C" int kernels_cutlass_run(const void*, const void*, void*, int, int, int, int64_t, int64_t, int64_t, void*,
                                   int, void* stream) {
  poke<<<1, 32, 0, static_cast<cudaStream_t>(stream)>>>(reinterpret_cast<int*>(0x10));   // unmapped address
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
"""


@pytest.mark.gpu_sweep      # builds one real CUTLASS kernel (56-68 s of nvcc on the H100): over -m gpu's 5 minutes;
def test_faulting_kernel_in_child_leaves_caller_working(backend, tmp_path):   # tests/interp/test_isolation.py
                                                                                # injects the fault on any machine
    # fp16 col x row is used by no other test here, so the planted binary shares no path with a loaded one
    a, b = _operands(512, 512, 512, "col", "row", torch.float16)
    problem = GemmProblem.from_tensors("mm", a, b)
    chosen, _ = backend.choices(problem)
    bad_choice = chosen[0]
    key, paths, _ = backend.artifact_paths(problem, bad_choice)
    good_choice = next(c for c in chosen[1:] if backend.artifact_paths(problem, c)[0] != key)
    # plant a faulting binary as the artifact of `bad_choice`, marker and all, so the normal load path picks it up
    paths.root.mkdir(parents=True, exist_ok=True)
    src = tmp_path / "fault.cu"
    src.write_text(FAULT_SOURCE)
    built = paths.root / ".fault.so.tmp"
    subprocess.run([str(backend.tools.nvcc), "-shared", "-Xcompiler", "-fPIC", f"-arch=sm_{problem.arch}", "-o",
                    str(built), str(src)], check=True, capture_output=True)
    os.replace(built, paths.binary)      # a new inode: never rewrite a file some process may have mapped
    publish_marker(paths, key, {"choice": bad_choice.name, "planted": "fault test"})
    outcomes = backend.build(problem, [bad_choice, good_choice])
    assert all(o.runner is not None for o in outcomes), [o.error for o in outcomes]
    results = backend.measure_isolated(problem, [o.runner for o in outcomes], 5.0)
    assert isinstance(results[bad_choice.name], str) and "crashed" in results[bad_choice.name]
    assert "illegal" in results[bad_choice.name].lower() or "status" in results[bad_choice.name]
    assert isinstance(results[good_choice.name], Timing)       # ran in a fresh child after the fault
    # the caller's context is intact: aten and a good CUTLASS runner still work here
    torch.cuda.synchronize()
    assert _rel_err(torch.mm(a, b), a.double() @ b.double()) < 1e-2
    out = outcomes[1].runner.launch(a, b, None)
    torch.cuda.synchronize()
    assert _rel_err(out, a.double() @ b.double()) < 1e-2
    paths.marker.unlink()       # leave no poisoned artifact in the shared cache


@pytest.mark.gpu_sweep
def test_kernels_mm_with_cutlass_backend(backend):
    kernels.config.backends = ("aten", "triton", "cutlass")
    a, b = _operands(2048, 2048, 2048, "row", "col", torch.bfloat16)
    c = kernels.mm(a, b)
    assert _rel_err(c, a.double() @ b.double()) < 1e-2
    sel = kernels.explain(a, b)
    timed = [n for n, t in sel.timings.items() if n.startswith("cutlass") and isinstance(t, float)]
    assert timed, sel.failures()
    a8, b8 = _operands(1024, 4096, 4096, "row", "col", torch.int8)
    assert torch.equal(kernels.int_mm(a8, b8), torch._int_mm(a8, b8))


# (m, n, k, dtype, bias, activation): small M gets the swapped kernels (the bias one value per kernel ROW), M=200 and
# N=4104 the direct ones with ragged tiles (one value per kernel column); each with an aligned and a misaligned bias
EPILOGUE_CASES = [(16, 4096, 4096, torch.bfloat16, True, "gelu"), (200, 4104, 1024, torch.bfloat16, True, "silu"),
                  (64, 4096, 4096, torch.float16, False, "relu")]


def _epilogue_picks(backend, m, n, k, dtype, has_bias, act):
    a, b = _operands(m, n, k, "row", "col", dtype)
    problem = GemmProblem.from_tensors("mm", a, b, bias=has_bias, activation=act)
    chosen, skipped = backend.choices(problem)
    picks = [c for c in chosen if "sm90" in c.name][:1] + [c for c in chosen if "sm80" in c.name][:1]
    assert picks, skipped
    return a, b, problem, picks


@pytest.fixture
def epilogue_binaries(backend):
    """Every case's picks compiled in one batch (per-case builds left most of the cores idle and took > 4 min)."""
    backend.prebuild([_epilogue_picks(backend, *case)[2:] for case in EPILOGUE_CASES])
    return backend


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,dtype,has_bias,act", EPILOGUE_CASES)
def test_cutlass_epilogues_match_the_reference(epilogue_binaries, m, n, k, dtype, has_bias, act):
    """An sm90 and (where offered) an sm80 CUTLASS choice per case, each against float64, with an aligned bias and
    a misaligned one (storage offset of one element)."""
    a, b, problem, picks = _epilogue_picks(epilogue_binaries, m, n, k, dtype, has_bias, act)
    outcomes = epilogue_binaries.build(problem, picks)
    failed = {o.choice.name: o.error for o in outcomes if o.runner is None}
    assert not failed, failed
    storage = torch.randn(n + 1, device="cuda").to(dtype)
    for bias in ((storage[:n].clone(), storage[1:]) if has_bias else (None,)):
        ops = (a, b) if bias is None else (a, b, bias)
        ref = reference(problem, *ops)
        for o in outcomes:
            out = o.runner.launch(*ops, None)
            torch.cuda.synchronize()
            assert _rel_err(out, ref) < 1e-2, (o.choice.name, bias is not None and bias.data_ptr() % 16)


# -- fp8: cutlass3x_sm90_scaled_mm (kernels.scaled_mm) ---------------------------------------------------------------
# (m, n, k, A dtype, scaling, bias, out dtype): both scalings, with and without the bias, every output dtype, odd M (1
# and 17: the swapped kernels, scale_a along the kernel's columns) beside M=256 (the direct ones) and K = 4096 + 16
# (a partial last k-block of 128). Each case builds its best swapped and best direct choice.
SCALED_CASES = [
    (1, 4096, 4096 + 16, "e4m3", "tensor", False, "bf16"),
    (17, 4096, 4096 + 16, "e4m3", "row", True, "bf16"),
    (256, 2048, 4096 + 16, "e4m3", "row", False, "fp16"),
    (17, 2048, 4096 + 16, "e5m2", "tensor", True, "fp32"),
    (1, 4096, 4096, "e4m3", "row", True, "fp32"),
    (256, 4096, 4096 + 16, "e4m3", "tensor", True, "fp16"),
]
SCALED_REPRESENTATIVE = SCALED_CASES[:4]


def _scaled_problem(m, n, k, dtype, scaling, bias, out):
    """The problem kernels.scaled_mm makes for these operands (A row-major, B = w.t() column-major, fresh buffers)."""
    a = torch.empty(m, k, device="cuda").to(DTYPES_BY_NAME[dtype])
    b = torch.empty(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    return GemmProblem.from_tensors("scaled_mm", a, b, bias=bias, scaling=scaling, out_dtype=out)


def _scaled_picks(backend, case):
    """The problem and its best direct and best swapped CUTLASS choice (one of each where offered)."""
    problem = _scaled_problem(*case)
    chosen, skipped = backend.choices(problem)
    picks = ([c for c in chosen if "_swap_" not in c.name][:1] + [c for c in chosen if "_swap_" in c.name][:1])
    assert picks, skipped
    return problem, picks


@pytest.fixture
def scaled_binaries(backend):
    """The representative cases' picks (what `pytest -m gpu` runs: at most 8 binaries) compiled in one batch; a sweep
    case builds its own in its test."""
    backend.prebuild([_scaled_picks(backend, case) for case in SCALED_REPRESENTATIVE])
    return backend


@pytest.mark.parametrize("m,n,k,dtype,scaling,has_bias,out", gpu_grid(SCALED_CASES, SCALED_REPRESENTATIVE))
def test_cutlass_scaled_mm_matches_the_reference(scaled_binaries, m, n, k, dtype, scaling, has_bias, out):
    """Each pick verified and timed in the isolated child, then launched here against the float64 reference: into
    a fresh output, a preallocated one and one whose rows are not 16-byte aligned (staged), with an aligned and a
    misaligned bias."""
    problem, picks = _scaled_picks(scaled_binaries, (m, n, k, dtype, scaling, has_bias, out))
    outcomes = scaled_binaries.build(problem, picks)
    failed = {o.choice.name: o.error for o in outcomes if o.runner is None}
    assert not failed, failed
    runners = [o.runner for o in outcomes]
    measured = scaled_binaries.measure_isolated(problem, runners, 5.0)
    bad = {name: r for name, r in measured.items() if not isinstance(r, Timing)}
    assert not bad, bad
    operands = make_inputs(problem, "cuda", seed=3)
    variants = [operands]
    if has_bias:      # the same bias one element off 16-byte alignment: the launcher hands the kernel a copy
        storage = torch.empty(n + 1, dtype=operands[-1].dtype, device="cuda")
        storage[1:].copy_(operands[-1])
        variants.append(operands[:-1] + (storage[1:],))
    ref = reference(problem, *operands)
    for r in runners:
        for ops in variants:
            result = r.launch(*ops, None)
            torch.cuda.synchronize()
            assert result.dtype == DTYPES_BY_NAME[out] and result.shape == (m, n), r.choice.name
            assert _rel_err(result, ref) < 1e-2, (r.choice.name, ops[-1].data_ptr() % 16)
        wide = torch.full((m, n + 3), float("nan"), dtype=DTYPES_BY_NAME[out], device="cuda")
        for given in (torch.empty(m, n, dtype=DTYPES_BY_NAME[out], device="cuda"), wide[:, :n]):
            assert r.launch(*operands, given) is given
            torch.cuda.synchronize()
            assert _rel_err(given, ref) < 1e-2, r.choice.name


@pytest.mark.gpu
def test_kernels_scaled_mm_tunes_with_the_cutlass_family(scaled_binaries):
    """kernels.scaled_mm with CUTLASS among the backends: the family's built picks are timed (verified in the child)
    beside torch._scaled_mm, and the answer matches the float64 reference."""
    case = SCALED_CASES[1]
    problem, picks = _scaled_picks(scaled_binaries, case)
    kernels.config.backends = ("aten", "cutlass")
    kernels.config.only = "|".join("^" + re.escape(c.name) + "$" for c in picks)
    a, b, scale_a, scale_b, bias = make_inputs(problem, "cuda", seed=5)
    out = kernels.scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=DTYPES_BY_NAME[problem.out_dtype])
    assert _rel_err(out, reference(problem, a, b, scale_a, scale_b, bias)) < 1e-2
    sel = kernels.explain(a, b, op="scaled_mm", scale_a=scale_a, scale_b=scale_b, bias=bias,
                          out_dtype=DTYPES_BY_NAME[problem.out_dtype])
    timed = {name for name, t in sel.timings.items() if name.startswith("cutlass3x_sm90_scaled_mm") and
             isinstance(t, float)}
    assert timed == {c.name for c in picks}, sel.failures()
