"""kernels.scaled_mm's warm calls through the C++ table (call_scaled_mm in kernels/native/csrc/fastpath.cpp): served
there for an aten winner (at::_scaled_mm computed in C++), a Triton winner (its launch called from there; on a GPU
its native launch), and the CPU fallback, with the Python path's results; declined to Python for what only Python may
decide (scales or a bias of other facts, `out`, autograd, subclasses, modes, another out dtype), and kept across the
table's reloads and shrinks. On the CPU nothing launches natively: a scaled NativeLaunch is checked up to the launch."""
import pytest
import torch

import kernels
from kernels.core.config import interpret_mode
from kernels.core.errors import InputTypeError, InputValueError
from kernels.dispatch import api, scaled
from tests.helpers import served

interpreted = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
E4M3 = torch.float8_e4m3fn
M, N, K = 24, 32, 64
TRITON_CHOICE = r"^triton_scaled_mm_e4m3_32x32x32_s4_w4_"


def operands(scaling="row", bias=False, out_dtype=torch.bfloat16, m=M, seed=0):
    """a (M, K) row-major, b (K, N) column-major, the scales and the bias (or None)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, K, generator=g).to(E4M3)
    b = torch.randn(N, K, generator=g).to(E4M3).t()
    if scaling == "row":
        sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, N, generator=g) + 0.5
    else:
        sa, sb = torch.tensor(0.75), torch.tensor([1.25])
    return a, b, sa, sb, torch.randn(N, generator=g).to(out_dtype) if bias else None


def reference(a, b, sa, sb, bias):
    out = (a.double() @ b.double()) * sa.double() * sb.double()
    return out if bias is None else out + bias.double()


def rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def warm(a, b, sa, sb, bias=None, out_dtype=torch.bfloat16):
    """A cold call, then one warm call: (result, calls the table served of the warm one)."""
    kernels.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    assert scaled._fast_call is not None, api._fast.why_not
    out = None

    def call():
        nonlocal out
        out = kernels.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)

    hits = served(call)
    return out, hits


def python_path(a, b, sa, sb, bias=None, out_dtype=torch.bfloat16):
    """The same call with the C++ table switched off: the Python warm table serves it."""
    fast_call, scaled._fast_call = scaled._fast_call, None
    try:
        return kernels.scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    finally:
        scaled._fast_call = fast_call


def entry_kind(a, b, scaling, bias, out_dtype=torch.bfloat16) -> int:
    return api._fast.module.kind(scaled._fast_key(a, b, scaling, bias, out_dtype))


EPILOGUES = [("tensor", False, torch.bfloat16), ("row", True, torch.bfloat16), ("row", False, torch.float16),
             ("tensor", True, torch.float32)]


@pytest.mark.parametrize("scaling,with_bias,out_dtype", EPILOGUES)
def test_aten_winner_is_computed_in_the_table_as_torch_does(fast, scaling, with_bias, out_dtype):
    a, b, sa, sb, bias = operands(scaling, with_bias, out_dtype)
    out, hits = warm(a, b, sa, sb, bias, out_dtype)
    assert hits == 1 and out.dtype == out_dtype and out.shape == (M, N)
    assert kernels.explain(a, b, op="scaled_mm", scale_a=sa, scale_b=sb, bias=bias,
                           out_dtype=out_dtype).winner == "aten_scaled_mm"
    assert entry_kind(a, b, scaling, bias, out_dtype) == scaled.FAST_ATEN_KIND
    expected = torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=out_dtype)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out, python_path(a, b, sa, sb, bias, out_dtype), rtol=0, atol=0)
    assert rel_err(out, reference(a, b, sa, sb, bias)) < 1e-2


@interpreted
@pytest.mark.parametrize("scaling,with_bias", [("row", True), ("tensor", False)])
def test_triton_winner_is_called_through_its_launch(fast, scaling, with_bias):
    kernels.config.backends = ("triton",)
    kernels.config.only = (TRITON_CHOICE,)
    a, b, sa, sb, bias = operands(scaling, with_bias)
    out, hits = warm(a, b, sa, sb, bias)
    sel = kernels.explain(a, b, op="scaled_mm", scale_a=sa, scale_b=sb, bias=bias)
    assert sel.winner.startswith("triton_scaled_mm_e4m3_32x32x32"), sel.timings
    assert hits == 1 and entry_kind(a, b, scaling, bias) == scaled.FAST_PYTHON_KIND    # no native launch on CPU
    torch.testing.assert_close(out, python_path(a, b, sa, sb, bias), rtol=0, atol=0)
    assert rel_err(out, reference(a, b, sa, sb, bias)) < 1e-2
    # other scales of the same facts: the same entry, the new values
    sa2, sb2 = sa * 2, sb + 1
    again = None

    def call():
        nonlocal again
        again = kernels.scaled_mm(a, b, sa2, sb2, bias=bias)

    assert served(call) == 1
    assert rel_err(again, reference(a, b, sa2, sb2, bias)) < 1e-2


@interpreted
def test_a_strided_bias_is_declined_and_copied_for_a_triton_winner(fast):
    """Triton kernels read bias[col] without a stride: the table declines a strided bias, and the Python path (cold
    and warm) hands the launch a contiguous copy."""
    kernels.config.backends = ("triton",)
    kernels.config.only = (TRITON_CHOICE,)
    a, b, sa, sb, bias = operands("row", True)
    kernels.scaled_mm(a, b, sa, sb, bias=bias)
    strided = torch.randn(2 * N).to(torch.bfloat16)[::2]
    ref = reference(a, b, sa, sb, strided)
    results = []
    for _ in range(2):                                      # cold (a new Python key), then warm
        assert served(lambda: results.append(kernels.scaled_mm(a, b, sa, sb, bias=strided))) == 0
    assert all(rel_err(out, ref) < 1e-2 for out in results), [rel_err(out, ref) for out in results]
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=bias)) == 1       # the unit-stride entry is intact


def test_cpu_fallback_entries_are_served_too(fast, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")             # CPU tensors: torch computes, nothing is tuned
    a, b, sa, sb, bias = operands("row", True, torch.float16)
    out, hits = warm(a, b, sa, sb, bias, torch.float16)
    assert hits == 1 and entry_kind(a, b, "row", bias, torch.float16) == scaled.FAST_ATEN_KIND
    torch.testing.assert_close(out, torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.float16), rtol=0, atol=0)


def test_scales_and_biases_of_other_facts_go_to_python(fast):
    a, b, sa, sb, bias = operands("row", True)
    kernels.scaled_mm(a, b, sa, sb, bias=bias)
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=bias)) == 1

    def declined(*args, **kwargs):
        result = []
        assert served(lambda: result.append(kernels.scaled_mm(*args, **kwargs))) == 0
        return result[0]

    # Python raises about these (validation)
    with pytest.raises(InputValueError, match="scales must both be"):
        declined(a, b, sa.view(M), sb, bias=bias)               # (M,) is not a row-wise scale
    with pytest.raises(InputTypeError, match="scale_a must be float32"):
        declined(a, b, sa.double(), sb, bias=bias)
    wide = torch.rand(M, 2) + 0.5
    with pytest.raises(InputValueError, match="contiguous"):
        declined(a, b, wide[:, :1], sb, bias=bias)              # (M, 1) with rows 2 apart
    with pytest.raises(InputTypeError, match="bias has dtype"):
        declined(a, b, sa, sb, bias=bias.half())
    with pytest.raises(InputValueError, match="bias must have shape"):
        declined(a, b, sa, sb, bias=bias[:16])
    with pytest.raises(InputTypeError, match="out_dtype"):
        declined(a, b, sa, sb, bias=bias, out_dtype=torch.int32)
    # valid calls the table does not serve as they are: Python serves them, right
    strided = torch.randn(2 * N).to(torch.bfloat16)[::2]        # stride 2
    out = declined(a, b, sa, sb, bias=strided)
    torch.testing.assert_close(out, torch._scaled_mm(a, b, sa, sb, bias=strided.contiguous(), out_dtype=torch.bfloat16),
                               rtol=0, atol=0)
    shifted = torch.randn(N + 1).to(torch.bfloat16)[1:]          # 2-byte aligned
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=shifted)) == 0
    out = torch.empty(M, N, dtype=torch.bfloat16)
    assert declined(a, b, sa, sb, bias=bias, out=out) is out
    torch.testing.assert_close(out, torch._scaled_mm(a, b, sa, sb, bias=bias, out_dtype=torch.bfloat16), rtol=0, atol=0)
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=bias)) == 1     # the entry is still there


def test_one_element_scales_of_any_servable_shape_share_the_entry(fast):
    a, b, sa, sb, _ = operands("tensor")
    kernels.scaled_mm(a, b, sa, sb)
    for shape_a, shape_b in [((), (1,)), ((1,), (1, 1)), ((1, 1), ())]:
        sa2, sb2 = sa.reshape(shape_a), sb.reshape(shape_b)
        out = None

        def call():
            nonlocal out
            out = kernels.scaled_mm(a, b, sa2, sb2)

        assert served(call) == 1, (shape_a, shape_b)
        torch.testing.assert_close(out, torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16), rtol=0, atol=0)
    # one element at stride 0: valid (Python serves it), not a unit last stride (the table declines)
    expanded = torch.tensor(0.75).expand(1)
    assert expanded.stride() == (0,)
    assert served(lambda: kernels.scaled_mm(a, b, expanded, sb)) == 0
    # row-wise scales are another op code: a miss, then their own entry
    _, _, sar, sbr, _ = operands("row")
    assert served(lambda: kernels.scaled_mm(a, b, sar, sbr)) == 0
    assert served(lambda: kernels.scaled_mm(a, b, sar, sbr)) == 1


def test_grad_subclasses_and_modes_stay_in_python(fast):
    a, b, sa, sb, bias = operands("row", True)
    kernels.scaled_mm(a, b, sa, sb, bias=bias)
    g = sa.clone().requires_grad_()

    def grad_call():
        with pytest.raises(InputValueError, match="not differentiable"):
            kernels.scaled_mm(a, b, g, sb, bias=bias)

    assert served(grad_call) == 0
    with torch.no_grad():
        assert served(lambda: kernels.scaled_mm(a, b, g, sb, bias=bias)) == 1     # nothing needs grad here

    class Sub(torch.Tensor):
        pass

    assert served(lambda: kernels.scaled_mm(a, b, sa.as_subclass(Sub), sb, bias=bias)) == 0
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=bias)) == 0
    assert seen


def test_entries_survive_a_reload_and_a_shrink(fast, monkeypatch):
    monkeypatch.setenv("KERNELS_FASTPATH", "off")
    a, b, sa, sb, bias = operands("row", True)
    kernels.scaled_mm(a, b, sa, sb, bias=bias)
    assert scaled._fast_call is None
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    kernels.mm(torch.randn(3, 8).half(), torch.randn(8, 4).half())     # a cold call loads the library
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=bias)) == 1

    kernels.config.max_problems = 4
    for m in range(5, 9):                                   # mm's fourth new problem shrinks its tables to 2
        kernels.mm(torch.randn(m, 8).half(), torch.randn(8, 4).half())
    assert len(api._dispatch) <= 4
    assert api._fast.module.size() == len(api._dispatch) + len(scaled._fast_entries)
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb, bias=bias)) == 1


def test_scaled_mm_loads_the_table_and_its_own_limit_empties_its_entries(fast):
    a, b, sa, sb, _ = operands("tensor")
    kernels.scaled_mm(a, b, sa, sb)                         # the first cold call of the process loads the table
    assert api._fast_call is not None and scaled._fast_call is not None
    kernels.mm(torch.randn(3, 8).half(), torch.randn(8, 4).half())
    assert api._fast.module.size() == 2
    kernels.config.max_problems = 2
    for m in (16, 32):                                      # the second new fp8 problem empties scaled_mm's tables
        kernels.scaled_mm(*operands("tensor", m=m)[:4])
    assert len(scaled._dispatch) == 1 and api._fast.module.size() == 2      # mm's entry and the newest fp8 one
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb)) == 0


def test_memory_hits_count_table_hits_and_clear_empties_it(fast):
    a, b, sa, sb, _ = operands("tensor")
    kernels.scaled_mm(a, b, sa, sb)
    hits = kernels.stats()["memory_hits"]
    kernels.scaled_mm(a, b, sa, sb)
    assert kernels.stats()["memory_hits"] == hits + 1
    kernels.clear_memory_cache()
    assert api._fast.module.size() == 0 and not scaled._fast_entries
    assert served(lambda: kernels.scaled_mm(a, b, sa, sb)) == 0


# -- native launches with scales: on CPU nothing launches, so these check the plumbing up to the launch -------------

def native(module, fallback, scaling="row", bias=True, out_dtype=torch.bfloat16):
    """A NativeLaunch of one step taking a, b, out, the scales (and the bias), for cuda:0; never launched on CPU
    tensors."""
    operands = [(0, 0), (1, 1), (2, 2), (3, 4), (4, 5)] + ([(5, 3)] if bias else [])
    step = (1, 1, 1, 1, 128, 0, [0] * (len(operands) + 2), operands)
    return module.native(0, 0, M, N, out_dtype, [step], fallback, (), scaling)


def test_native_launch_takes_the_scales_after_b(fast):
    kernels.mm(torch.randn(2, 4).half(), torch.randn(4, 3).half())          # loads the library
    module = api._fast.module
    calls = []

    def fallback(*args):
        calls.append(args)
        return torch.zeros(M, N).bfloat16()

    launch = native(module, fallback)
    assert "row-scaled + bias" in repr(launch)
    a, b, sa, sb, bias = operands("row", True)
    launch(a, b, sa, sb, bias)                              # CPU tensors: the Python path runs it
    out = torch.empty(M, N).bfloat16()
    launch(a, b, sa, sb, bias, out)
    assert [c[2:] for c in calls] == [(sa, sb, bias, None), (sa, sb, bias, out)]
    with pytest.raises(TypeError, match=r"NativeLaunch\(a, b, scale_a, scale_b, bias, out=None\) takes 5 or 6"):
        launch(a, b, sa, sb)
    without = native(module, fallback, scaling="tensor", bias=False)
    assert "tensor-scaled" in repr(without) and "bias" not in repr(without)
    without(a, b, sa, sb)
    assert calls[-1][2:] == (sa, sb, None)
    step = (1, 1, 1, 1, 128, 0, [0] * 7, [(0, 0), (1, 1), (2, 2), (3, 4), (4, 5)])
    for bad in ("", "rows", None):                          # scales without a scaling that says their size
        with pytest.raises(ValueError, match="scaling must be"):
            module.native(0, 0, M, N, torch.bfloat16, [step], fallback, (), bad)
    with pytest.raises(ValueError, match="scaling must be"):                 # a scaling without scales
        module.native(0, 0, M, N, torch.bfloat16, [(1, 1, 1, 1, 128, 0, [0, 0, 0], [(0, 0)])], fallback, (), "row")


def test_native_entry_must_match_its_key_and_is_served_through_its_fallback_on_cpu(fast):
    a, b, sa, sb, bias = operands("row", True)
    kernels.scaled_mm(a, b, sa, sb, bias=bias)
    module = api._fast.module
    seen = []

    def fallback(*args):
        seen.append(args)
        return torch._scaled_mm(*args[:4], bias=args[4], out_dtype=torch.bfloat16)

    key = scaled._fast_key(a, b, "row", bias, torch.bfloat16)
    for wrong in (native(module, fallback, scaling="tensor"), native(module, fallback, bias=False),
                  native(module, fallback, out_dtype=torch.float16)):
        with pytest.raises(ValueError, match="cannot compute"):
            module.add(key, scaled.FAST_PYTHON_KIND, wrong)
    with pytest.raises(ValueError, match="cannot compute"):
        module.add(key, 0, torch.mm)                        # at::mm does not scale
    with pytest.raises(ValueError, match="cannot compute"):
        module.add(api._fast_key("mm", torch.randn(2, 2).half(), torch.randn(2, 2).half()), scaled.FAST_ATEN_KIND,
                   None)                                    # at::_scaled_mm does not compute mm
    assert module.add(key, scaled.FAST_PYTHON_KIND, native(module, fallback)) is True
    assert module.kind(key) == 3
    out = None

    def call():
        nonlocal out
        out = kernels.scaled_mm(a, b, sa, sb, bias=bias)

    assert served(call) == 1
    assert len(seen) == 1 and all(x is y for x, y in zip(seen[0], (a, b, sa, sb, bias))) and seen[0][5] is None
    assert rel_err(out, reference(a, b, sa, sb, bias)) < 1e-2
    assert module.discard(key) is True and module.discard(key) is False and module.kind(key) == -1
