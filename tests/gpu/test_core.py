"""GPU: kernels.mm / kernels.int_mm vs torch over shapes, dtypes and layouts; warm processes do no work.
`pytest -m gpu` tunes one case per dtype and layout; `pytest -m gpu_sweep` the rest of each grid."""
import itertools
import json
import textwrap

import pytest
import torch

import kernels
from tests.helpers import gpu_grid, run_python
from tests.triton_helpers import cuda_operand as operand, rel_err

MM_GRID = [(dtype, *shape, *layouts) for dtype, shape, layouts in itertools.product(
    [torch.bfloat16, torch.float16, torch.float32],
    [(1, 1, 1), (17, 33, 65), (128, 1, 300), (257, 129, 1000), (1024, 1024, 1024), (16, 4096, 4096)],
    [("row", "row"), ("col", "col"), ("sliced", "col")])]
MM_EACH_DTYPE_AND_LAYOUT = [(torch.bfloat16, 1024, 1024, 1024, "row", "row"), (torch.float16, 17, 33, 65, "col", "col"),
                            (torch.float32, 257, 129, 1000, "sliced", "col")]
INT_MM_GRID = [(*shape, lb) for shape in [(8, 64, 64), (33, 48, 96), (1024, 2048, 512), (256, 12288, 4096)]
               for lb in ("row", "col")]
INT_MM_EACH_PATH = [(8, 64, 64, "col"), (1024, 2048, 512, "row")]      # M <= 16 (no torch._int_mm) and M > 16


@pytest.mark.parametrize("dtype,m,n,k,la,lb", gpu_grid(MM_GRID, MM_EACH_DTYPE_AND_LAYOUT))
def test_mm_matches_torch(dtype, m, n, k, la, lb):
    a, b = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    c = kernels.mm(a, b)
    tol = 2e-3 if dtype == torch.float32 else 1e-2
    assert c.shape == (m, n) and c.dtype == dtype and rel_err(c, a, b) < tol
    # the warm path gives the same answer on new data of the same problem
    a2, b2 = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    assert rel_err(kernels.mm(a2, b2), a2, b2) < tol


@pytest.mark.parametrize("m,n,k,lb", gpu_grid(INT_MM_GRID, INT_MM_EACH_PATH))
def test_int_mm_exact(m, n, k, lb):
    a, b = operand(m, k, "row", torch.int8), operand(k, n, lb, torch.int8)
    c = kernels.int_mm(a, b)
    assert c.dtype == torch.int32 and torch.equal(c.double(), a.double() @ b.double())
    sel = kernels.explain(a, b, op="int_mm")
    if m <= 16:
        assert sel.timings["aten_int_mm"].startswith("unsupported: torch._int_mm needs M > 16")


@pytest.mark.gpu
def test_every_triton_candidate_is_verified_not_just_the_winner():
    a, b = operand(300, 200, "row", torch.bfloat16), operand(200, 100, "col", torch.bfloat16)
    sel = kernels.explain(a, b)
    triton_times = [t for n, t in sel.timings.items() if n.startswith("triton_mm")]
    assert len(triton_times) >= 5 and all(isinstance(t, float) for t in triton_times), sel.failures()


@pytest.mark.gpu
def test_out_argument_and_streams():
    a, b = operand(200, 64, "row", torch.float16), operand(64, 96, "row", torch.float16)
    ref = a.double() @ b.double()
    out = torch.empty(200, 96, device="cuda", dtype=torch.float16)
    assert kernels.mm(a, b, out=out) is out and rel_err(out, a, b) < 1e-2
    out_col = torch.empty(96, 200, device="cuda", dtype=torch.float16).t()
    kernels.mm(a, b, out=out_col)
    assert rel_err(out_col, a, b) < 1e-2
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        c = kernels.mm(a, b)
    s.synchronize()
    assert float((c.double() - ref).norm() / ref.norm()) < 1e-2


WARM = textwrap.dedent("""
    import json, time, torch, kernels
    torch.manual_seed(0)
    a = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(384, 640, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter(); c = kernels.mm(a, b); torch.cuda.synchronize(); first = time.perf_counter() - t0
    err = float((c.double() - a.double() @ b.double()).norm() / (a.double() @ b.double()).norm())
    print(json.dumps({"stats": kernels.stats(), "err": err, "first_s": first, "winner": kernels.explain(a, b).winner}))
""")


@pytest.mark.gpu
def test_fresh_process_with_warm_caches_compiles_and_benchmarks_nothing(isolated_cache):
    env = {"KERNELS_CACHE_DIR": str(isolated_cache), "KERNELS_BACKENDS": "triton", "TRITON_INTERPRET": None}
    cold = run_python(WARM, env)
    assert cold.returncode == 0, cold.stderr[-3000:]
    first = json.loads(cold.stdout.strip().splitlines()[-1])
    assert first["err"] < 1e-2 and first["stats"]["compiles"] > 0 and first["stats"]["tunes"] == 1
    warm = run_python(WARM, env)
    assert warm.returncode == 0, warm.stderr[-3000:]
    second = json.loads(warm.stdout.strip().splitlines()[-1])
    assert second["err"] < 1e-2 and second["winner"] == first["winner"]
    s = second["stats"]
    assert s["compiles"] == 0 and s["benchmarks"] == 0 and s["tunes"] == 0 and s["disk_hits"] == 1


@pytest.mark.gpu
def test_new_shape_reuses_built_binaries(isolated_cache):
    kernels.config.backends = ("triton",)
    # triton_mm's configs do not depend on M (split-K's do: its split follows the tile count)
    kernels.config.only = "^triton_mm_"
    a, b = operand(1024, 512, "row", torch.bfloat16), operand(512, 768, "row", torch.bfloat16)
    kernels.mm(a, b)
    compiled = kernels.stats()["compiles"]
    a2 = operand(2048, 512, "row", torch.bfloat16)          # same specialisation (M % 16 == 0), new M
    kernels.mm(a2, b)
    assert kernels.stats()["compiles"] == compiled


@pytest.mark.gpu
def test_a_broadcast_operand_is_served_right_and_never_by_a_tma_kernel():
    """B = w.expand(K, N) (stride 0): plain loads read it right, a TMA descriptor need not, so TMA kernels are not
    offered for it (CUTLASS sm90's refusal: tests/unit/test_cutlass_heuristics.py)."""
    kernels.config.backends = ("aten", "triton")
    a = operand(512, 512, "row", torch.bfloat16)
    b = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16).expand(512, 512)
    c = kernels.mm(a, b)
    assert rel_err(c, a, b) < 1e-2
    timings = kernels.explain(a, b).timings         # timed candidates' ms; families left out: why
    timed = [n for n, t in timings.items() if isinstance(t, float)]
    assert any(n.startswith("triton_mm") for n in timed)
    assert not any("tma" in n for n in timed), timed
    assert "rows do not overlap" in timings["triton_tma_mm"]
