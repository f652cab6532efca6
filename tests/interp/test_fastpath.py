"""The C++ warm-call table (kernels/fastpath.py, kernels/csrc/fastpath.cpp): built once for the session, then each
test copies it into its own cache dir. It must serve exactly the calls the Python table would (same key), decline
what it cannot serve (fp32, autograd, subclasses, torch-function modes), and never take a call down."""
import shutil
import threading

import pytest
import torch

import kernels
from kernels.dispatch import api
from kernels.native import fastpath
from kernels.core.config import interpret_mode
from tests.triton_helpers import assert_close, build_offered


@pytest.fixture(scope="session")
def built_library(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fastpath_build")
    mp = pytest.MonkeyPatch()
    mp.setenv("KERNELS_CACHE_DIR", str(folder))          # unless KERNELS_FASTPATH_DIR names a shared build
    try:
        return fastpath.build()
    finally:
        mp.undo()


@pytest.fixture
def fast(built_library, monkeypatch):
    """The library in this test's cache dir, KERNELS_FASTPATH=auto, and a fresh Fastpath state (restored after)."""
    monkeypatch.delenv("KERNELS_FASTPATH_DIR", raising=False)    # a shared build dir serves only the session build
    where = fastpath.paths()
    where.folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(built_library, where.library)
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    monkeypatch.setattr(api, "_fast", fastpath.Fastpath())
    monkeypatch.setattr(api, "_fast_call", None)
    kernels.config.backends = ("aten",)
    return where


def served(fn):
    """How many calls the C++ table served while fn ran."""
    before = api._fast.module.hits() if api._fast.module is not None else 0
    fn()
    return api._fast.module.hits() - before


def test_aten_winner_is_served_by_the_table_with_the_same_result(fast):
    a, b = torch.randn(8, 12).half(), torch.randn(12, 5).half()
    first = kernels.mm(a, b)
    assert api._fast_call is not None, api._fast.why_not
    assert served(lambda: kernels.mm(a, b)) == 1
    torch.testing.assert_close(kernels.mm(a, b), torch.mm(a, b), rtol=0, atol=0)
    torch.testing.assert_close(first, torch.mm(a, b), rtol=0, atol=0)
    hits = kernels.stats()["memory_hits"]
    kernels.mm(a, b)
    assert kernels.stats()["memory_hits"] == hits + 1


def test_int_mm_aten_winner(fast):
    a = torch.randint(-128, 128, (32, 16), dtype=torch.int8)
    b = torch.randint(-128, 128, (16, 8), dtype=torch.int8)
    kernels.int_mm(a, b)
    out = None

    def call():
        nonlocal out
        out = kernels.int_mm(a, b)

    assert served(call) == 1
    assert out.dtype == torch.int32 and torch.equal(out, torch.mm(a.int(), b.int()))


def test_layout_and_alignment_are_part_of_the_key(fast):
    a, b = torch.randn(8, 12).half(), torch.randn(12, 6).half()
    kernels.mm(a, b)
    at = a.t().contiguous().t()                        # same shape, column-major: another problem
    assert served(lambda: kernels.mm(at, b)) == 0
    assert served(lambda: kernels.mm(at, b)) == 1
    storage = torch.randn(8 * 12 + 1).half()
    shifted = storage[1:].view(8, 12)                  # same shape and strides, 2-byte aligned
    assert served(lambda: kernels.mm(shifted, b)) == 0
    torch.testing.assert_close(kernels.mm(shifted, b), torch.mm(shifted, b), rtol=0, atol=0)


def test_declined_calls_take_the_python_path(fast):
    a16, b16 = torch.randn(4, 4).half(), torch.randn(4, 4).half()
    kernels.mm(a16, b16)
    module = api._fast.module
    assert module.add(api._fast_key("mm", torch.randn(2, 2), torch.randn(2, 2)), 0, torch.mm) is False   # fp32
    a32, b32 = torch.randn(4, 4), torch.randn(4, 4)
    kernels.mm(a32, b32)
    assert served(lambda: kernels.mm(a32, b32)) == 0 and kernels.mm(a32, b32).shape == (4, 4)

    g = torch.randn(4, 4).half().requires_grad_()
    kernels.mm(g.detach(), b16)                         # the same key without grad is registered
    result = None

    def grad_call():
        nonlocal result
        result = kernels.mm(g, b16)

    assert served(grad_call) == 0 and result.grad_fn is not None

    class Sub(torch.Tensor):
        pass

    sub = a16.as_subclass(Sub)
    assert served(lambda: kernels.mm(sub, b16)) == 0

    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        assert served(lambda: kernels.mm(a16, b16)) == 0
    assert torch.mm in seen


def test_out_and_dynamic_calls_stay_in_python(fast):
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, b)
    out = torch.empty(4, 4).half()
    assert served(lambda: kernels.mm(a, b, out=out)) == 0
    torch.testing.assert_close(out, torch.mm(a, b), rtol=0, atol=0)


def test_entries_made_before_the_load_are_registered_on_load(fast, monkeypatch):
    monkeypatch.setenv("KERNELS_FASTPATH", "off")
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, b)
    assert api._fast_call is None and api._fast.why_not == "KERNELS_FASTPATH=off"
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    kernels.mm(torch.randn(3, 8).half(), b)             # a cold call loads the library
    assert api._fast.module.size() == 2
    assert served(lambda: kernels.mm(a, b)) == 1


def test_background_build_switches_warm_calls_over(fast, built_library, monkeypatch):
    fast.library.unlink()
    release = threading.Event()

    def gated_build(force=False):
        assert release.wait(30)
        shutil.copy(built_library, fast.library)        # what the compile publishes
        return fast.library

    monkeypatch.setattr(fastpath, "build", gated_build)
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    kernels.mm(a, b)
    assert api._fast_call is None and api._fast.why_not == "building in the background"
    kernels.mm(a, b)                                    # warm, through the Python table meanwhile
    release.set()
    api._fast.wait(30)
    assert api._fast_call is not None
    assert served(lambda: kernels.mm(a, b)) == 1       # registered although no cold call happened since


def test_failed_build_is_recorded_and_calls_still_work(fast, monkeypatch):
    fast.library.unlink()
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("KERNELS_FASTPATH", "build")
    with pytest.raises(fastpath.FastpathBuildError, match="not found"):
        fastpath.build()
    where = fastpath.paths()                            # CXX is part of the build tag
    assert where.failed.exists() and "not found" in where.log.read_text()
    a, b = torch.randn(4, 8).half(), torch.randn(8, 4).half()
    torch.testing.assert_close(kernels.mm(a, b), torch.mm(a, b), rtol=0, atol=0)
    assert api._fast_call is None and "failed earlier" in api._fast.why_not


def test_leftover_temp_files_are_not_loaded(fast):
    (fast.folder / f".{fastpath.MODULE_NAME}.1234.deadbeef.so").write_bytes(b"half-written")
    assert fastpath.build() == fast.library            # the published library is what loads


def test_clear_memory_cache_empties_the_table(fast):
    kernels.mm(torch.randn(4, 8).half(), torch.randn(8, 4).half())
    assert api._fast.module.size() == 1
    kernels.clear_memory_cache()
    assert api._fast.module.size() == 0


@pytest.mark.skipif(not interpret_mode(), reason="Triton winners on CPU need TRITON_INTERPRET=1")
def test_triton_winner_is_called_through_its_launcher(fast):
    kernels.config.backends = ("triton",)
    kernels.config.only = (r"^triton_mm_fp16_32x16x16_s1_",)
    a, b = torch.randn(17, 33).half(), torch.randn(33, 9).half()
    kernels.mm(a, b)
    assert kernels.explain(a, b).winner.startswith("triton_mm_")
    out = None

    def call():
        nonlocal out
        out = kernels.mm(a, b)

    assert served(call) == 1
    torch.testing.assert_close(out, torch.mm(a.float(), b.float()).half(), rtol=2e-3, atol=2e-3)


GPU_CASES = [("mm", torch.bfloat16, (256, 512, 128)), ("mm", torch.float16, (17, 33, 65)),
             ("int_mm", torch.int8, (64, 128, 64))]


@pytest.mark.gpu
@pytest.mark.parametrize("backends", [("aten",), ("triton",)])
@pytest.mark.parametrize("op,dtype,shape", GPU_CASES)
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
