"""GPU: the C++ warm-call table on a GPU -- warm calls served and right, every Triton family's native launch on
every path (repeated, `out`, another stream, graph capture), and a Triton winner as a native entry, for mm and for
fp8 scaled_mm (the CPU tests are tests/interp/test_fastpath*.py). `pytest -m gpu` serves each dtype's warm call once (Triton bf16 also through
test_gpu_triton_winner_is_a_native_entry); `pytest -m gpu_sweep` the other backend of each."""
import pytest
import torch

import kernels
from kernels.dispatch import api
from tests.helpers import gpu_grid, served
from tests.triton_helpers import assert_close, build_offered


GPU_CASES = [("mm", torch.bfloat16, (256, 512, 128)), ("mm", torch.float16, (17, 33, 65)),
             ("int_mm", torch.int8, (64, 128, 64))]
WARM_GRID = [(backends, *case) for backends in [("aten",), ("triton",)] for case in GPU_CASES]
WARM_EACH_DTYPE = [(("aten",), *GPU_CASES[0]), (("aten",), *GPU_CASES[1]), (("triton",), *GPU_CASES[2])]


@pytest.mark.parametrize("backends,op,dtype,shape", gpu_grid(WARM_GRID, WARM_EACH_DTYPE))
def test_gpu_warm_calls_are_served_and_match_torch(fast, backends, op, dtype, shape):
    kernels.config.backends = backends
    m, n, k = shape
    if dtype == torch.int8:
        a = torch.randint(-128, 128, (m, k), dtype=dtype, device="cuda")
        b = torch.randint(-128, 128, (k, n), dtype=dtype, device="cuda")
    else:
        a = torch.randn(m, k, device="cuda").to(dtype)
        b = torch.randn(k, n, device="cuda").to(dtype)
    fn = kernels.int_mm if op == "int_mm" else kernels.mm
    fn(a, b)
    out = None

    def call():
        nonlocal out
        out = fn(a, b)

    assert served(call) == 1, kernels.fastpath_status()
    assert kernels.explain(a, b, op=op).winner.startswith(backends[0])
    if op == "int_mm":
        assert torch.equal(out.cpu(), a.cpu().int() @ b.cpu().int())     # CUDA has no int32 matmul
    else:
        torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)


NATIVE_CASES = [  # template, dtype, (m, n, k), B column-major: every Triton family, ragged and aligned
    ("triton_mm", torch.bfloat16, (17, 33, 64), False),
    ("triton_mm", torch.float16, (256, 512, 128), True),
    ("triton_int8_mm", torch.int8, (32, 48, 64), True),
    ("triton_tma_mm", torch.bfloat16, (512, 256, 512), False),
    ("triton_tma_int8_mm", torch.int8, (256, 256, 512), True),
    ("split_k", torch.bfloat16, (32, 32, 4096), False),
    ("split_k", torch.int8, (32, 64, 4096), False),
    ("decompose_k", torch.bfloat16, (32, 32, 4096), False),
    ("triton_kmajor_int8_mm", torch.int8, (64, 128, 256), False),
    ("triton_padded_mm", torch.bfloat16, (17, 33, 65), False),
    ("triton_padded_int8_mm", torch.int8, (17, 33, 65), False),
]


def gpu_operand(shape, dtype, col=False):
    rows, cols = shape[::-1] if col else shape
    if dtype == torch.int8:
        t = torch.randint(-128, 128, (rows, cols), dtype=dtype, device="cuda")
    else:
        t = torch.randn(rows, cols, device="cuda").to(dtype)
    return t.t() if col else t


@pytest.mark.gpu
@pytest.mark.parametrize("template,dtype,shape,b_col", NATIVE_CASES)
def test_gpu_native_launch_matches_torch_on_every_path(fast, template, dtype, shape, b_col):
    """The C++ launch of each family: right on repeated calls (workspaces stay clean), into a caller's `out`, on
    another stream (the Python path takes over), under CUDA-graph capture, and beside the Python path."""
    from kernels.measure.timing import device_time_ms, user_call

    assert kernels.load_fastpath() == "loaded"
    m, n, k = shape
    a, b = gpu_operand((m, k), dtype), gpu_operand((k, n), dtype, col=b_col)
    for outcome in build_offered(template, a, b, limit=2):
        launch = outcome.runner.launch
        assert launch.native_why == "", launch.native_why
        for _ in range(3):
            assert_close(launch.native(a, b), a, b)
        out = torch.full((m, n), -1, dtype=torch.int32 if dtype == torch.int8 else dtype, device="cuda")
        assert launch.native(a, b, out) is out
        assert_close(out, a, b)
        wide = torch.zeros(m, n + 3, dtype=out.dtype, device="cuda")[:, :n]     # rows longer than N: Python path
        launch.native(a, b, wide)
        assert_close(wide, a, b)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            c = launch.native(a, b)
        side.synchronize()
        assert_close(c, a, b)
        assert_close(launch(a, b, None), a, b)
        assert device_time_ms(user_call(launch, [(a, b)]), 1) is not None
        assert_close(launch.native(a, b), a, b)


@pytest.mark.gpu
def test_gpu_triton_winner_is_a_native_entry(fast):
    kernels.config.backends = ("triton",)
    a, b = gpu_operand((32, 4096), torch.bfloat16), gpu_operand((4096, 32), torch.bfloat16)
    assert kernels.load_fastpath() == "loaded"
    kernels.mm(a, b)
    assert api._fast.module.kind(api._fast_key("mm", a, b)) == 3        # kNative: launched without Python
    out = None

    def call():
        nonlocal out
        out = kernels.mm(a, b)

    assert served(call) == 1
    torch.testing.assert_close(out.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)


# -- scaled_mm (fp8): native launches take the scales (and the bias); a Triton winner is a native entry -------------

SCALED_FAMILIES = ("triton_scaled_mm", "triton_tma_scaled_mm", "split_k")
SCALED_EPILOGUES = [("row", True, "bf16"), ("tensor", False, "fp32")]


def scaled_problem(m, n, k, scaling, bias, out_dtype):
    from kernels.core.problem import GemmProblem

    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="cuda")
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="cuda").t()
    return GemmProblem.from_tensors("scaled_mm", a, b, bias=bias, scaling=scaling, out_dtype=out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("template", SCALED_FAMILIES)
@pytest.mark.parametrize("scaling,bias,out_dtype", SCALED_EPILOGUES)
def test_gpu_scaled_native_launch_matches_the_reference_on_every_path(fast, template, scaling, bias, out_dtype):
    """Each fp8 family's C++ launch: right on repeated calls, into a caller's `out`, on another stream and into rows
    longer than N (the Python path takes over), beside the Python path."""
    from backends.triton import TritonBackend
    from backends.triton_templates import family
    from kernels.measure.verify import check, make_inputs, poisoned_output, reference

    assert kernels.load_fastpath() == "loaded"
    p = scaled_problem(32, 256, 4096, scaling, bias, out_dtype)
    choices, skipped = family(template).choices(p, template, "default")
    assert choices, skipped
    (outcome,) = TritonBackend().build(p, choices[:1])
    assert outcome.runner is not None, outcome.error
    launch = outcome.runner.launch
    assert launch.native_why == "", launch.native_why
    operands = make_inputs(p, "cuda", seed=3)
    ref = reference(p, *operands)
    for _ in range(3):
        assert check(p, launch.native(*operands), ref).ok
    out = poisoned_output(p, "cuda")
    assert launch.native(*operands, out) is out and check(p, out, ref).ok
    wide = torch.zeros(p.m, p.n + 8, dtype=out.dtype, device="cuda")[:, :p.n]
    launch.native(*operands, wide)
    assert check(p, wide, ref).ok
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        c = launch.native(*operands)
    side.synchronize()
    assert check(p, c, ref).ok
    assert check(p, launch(*operands, None), ref).ok


@pytest.mark.gpu
@pytest.mark.parametrize("scaling,with_bias,out_dtype", [("row", True, torch.bfloat16),
                                                         ("tensor", False, torch.float16)])
def test_gpu_scaled_triton_winner_is_a_native_entry(fast, scaling, with_bias, out_dtype):
    """A warm kernels.scaled_mm with a Triton winner is launched from C++ (kNative) and matches torch._scaled_mm."""
    from kernels.dispatch import scaled

    kernels.config.backends = ("triton",)
    torch.manual_seed(0)
    m, n, k = 16, 1024, 4096
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    if scaling == "row":
        sa, sb = torch.rand(m, 1, device="cuda") + 0.5, torch.rand(1, n, device="cuda") + 0.5
    else:
        sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(1.5, device="cuda")
    bias = torch.randn(n, device="cuda").to(out_dtype) if with_bias else None
    assert kernels.load_fastpath() == "loaded"
    kernels.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    sel = kernels.explain(a, b, op="scaled_mm", scale_a=sa, scale_b=sb, bias=bias, out_dtype=out_dtype)
    assert sel.winner_choice.backend == "triton", sel.winner
    assert api._fast.module.kind(scaled._fast_key(a, b, scaling, bias, out_dtype)) == 3    # kNative
    out = None

    def call():
        nonlocal out
        out = kernels.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)

    assert served(call) == 1
    expected = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    assert out.dtype == out_dtype
    assert float((out.float() - expected.float()).norm() / expected.float().norm()) < 1e-2
