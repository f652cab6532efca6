"""The C++ warm-call table (kernels/native/fastpath.py, kernels/native/csrc/fastpath.cpp) on CPU: built once for
the session, then each test copies it into its own cache dir (the `fast` fixture, tests/conftest.py). It must serve
exactly the calls the Python table would (same key), decline what it cannot serve (fp32, autograd, subclasses,
torch-function modes), and never take a call down."""
import shutil
import threading

import pytest
import torch

import kernels
from kernels.dispatch import api
from kernels.native import fastpath
from kernels.core.config import interpret_mode
from tests.helpers import served


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
