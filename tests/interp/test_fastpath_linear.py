"""kernels.linear's warm calls through the C++ table (call_linear in kernels/native/csrc/fastpath.cpp): served there for
every entry kind it holds (aten_addmm computed in C++, a Python launch called from there, a native launch's plumbing),
with the Python warm path's results; declined to Python for what only Python may decide (a copy of x, a bias it would
not pass as is, autograd, subclasses, modes, fp32), and kept across the table's reloads and shrinks."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import kernels
from kernels.core.config import interpret_mode
from kernels.core.errors import InputTypeError, InputValueError
from kernels.dispatch import api
from tests.helpers import served

ACTIVATIONS = (None, "relu", "gelu", "silu")


def reference(x, w, bias, activation):
    out = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    if activation == "relu":
        out = torch.relu(out)
    elif activation == "gelu":
        out = F.gelu(out, approximate="tanh")
    elif activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def python_path(x, w, bias=None, activation=None):
    """The same call with the C++ table switched off: the Python warm table serves it."""
    fast_call, api._fast_call = api._fast_call, None
    try:
        return kernels.linear(x, w, bias, activation=activation)
    finally:
        api._fast_call = fast_call


def warm(x, w, bias=None, activation=None):
    """A cold call, then one warm call: (result, calls the table served of the warm one)."""
    kernels.linear(x, w, bias, activation=activation)
    assert api._fast_call is not None, api._fast.why_not
    out = None

    def call():
        nonlocal out
        out = kernels.linear(x, w, bias, activation=activation)

    hits = served(call)
    return out, hits


def linear_key(x, w, bias=None, activation=None):
    x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return (api._fast_key("mm", x2, w.t()), activation,
            None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.device))


@pytest.mark.parametrize("with_bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_aten_winner_is_computed_in_the_table_as_the_python_path_does(fast, activation, with_bias):
    x, w = torch.randn(6, 24).half(), torch.randn(10, 24).half()
    bias = torch.randn(10).half() if with_bias else None
    out, hits = warm(x, w, bias, activation)
    assert hits == 1
    assert kernels.explain(x, w, op="linear", bias=bias, activation=activation).winner in ("aten_addmm", "aten_mm")
    plain = bias is None and activation is None
    assert api._fast.module.kind(linear_key(x, w, bias, activation)) == (0 if plain else api._FAST_ADDMM_KIND)
    torch.testing.assert_close(out, python_path(x, w, bias, activation), rtol=0, atol=0)
    torch.testing.assert_close(out, reference(x, w, bias, activation), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("shape", [(2, 3, 16), (16,), (2, 1, 3, 16)], ids=["3d", "1d", "4d"])
def test_x_flattened_by_a_view_is_served_and_shaped_back(fast, shape):
    x, w, bias = torch.randn(shape).bfloat16(), torch.randn(8, 16).bfloat16(), torch.randn(8).bfloat16()
    out, hits = warm(x, w, bias, "gelu")
    assert hits == 1 and out.shape == (*shape[:-1], 8)
    torch.testing.assert_close(out, python_path(x, w, bias, "gelu"), rtol=0, atol=0)
    torch.testing.assert_close(out, reference(x, w, bias, "gelu"), rtol=2e-2, atol=2e-2)


def test_x_that_only_a_copy_flattens_is_left_to_python(fast):
    x = torch.randn(4, 3, 16).half().transpose(0, 1)        # (3, 4, 16), rows 48 apart: reshape copies
    w, bias = torch.randn(8, 16).half(), torch.randn(8).half()
    out, hits = warm(x, w, bias, "relu")
    assert hits == 0 and out.shape == (3, 4, 8)
    torch.testing.assert_close(out, reference(x, w, bias, "relu"), rtol=2e-3, atol=2e-3)
    xc = x.contiguous()                                     # the copy's problem is the one registered
    assert served(lambda: kernels.linear(xc, w, bias, activation="relu")) == 1


def test_a_bias_the_table_would_not_pass_as_is_goes_to_python(fast):
    x, w = torch.randn(5, 16).half(), torch.randn(8, 16).half()
    bias = torch.randn(8).half()
    kernels.linear(x, w, bias)
    strided = torch.randn(16).half()[::2]                   # stride 2: the Python path copies it
    assert served(lambda: kernels.linear(x, w, strided)) == 0
    torch.testing.assert_close(kernels.linear(x, w, strided), reference(x, w, strided, None), rtol=2e-3, atol=2e-3)
    assert served(lambda: kernels.linear(x, w, strided)) == 0       # its entry stays Python's
    shifted = torch.randn(9).half()[1:]                     # 2-byte aligned
    assert served(lambda: kernels.linear(x, w, shifted)) == 0
    torch.testing.assert_close(kernels.linear(x, w, shifted), reference(x, w, shifted, None), rtol=2e-3, atol=2e-3)
    with pytest.raises(InputTypeError, match="bias has dtype torch.float32"):
        kernels.linear(x, w, bias.float())
    with pytest.raises(InputValueError, match="bias must have shape"):
        kernels.linear(x, w, torch.randn(7).half())
    with pytest.raises(InputValueError, match="unknown activation"):
        kernels.linear(x, w, bias, activation="tanh")
    assert served(lambda: kernels.linear(x, w, bias)) == 1


def test_autograd_subclasses_modes_and_fp32_stay_in_python(fast):
    layer = nn.Linear(16, 8).half()
    x = torch.randn(4, 16).half()
    with torch.no_grad():
        out, hits = warm(x, layer.weight, layer.bias)
    assert hits == 1 and out.grad_fn is None                # an nn.Parameter is a plain tensor here, as for torch
    result = None

    def grad_call():
        nonlocal result
        result = kernels.linear(x, layer.weight, layer.bias)

    # the first grad call is declined (its route is worked out): aten won the layer's products, so it is torch's own
    # F.linear; from then on the table serves the route (at::linear under grad mode, torch's autograd records it)
    assert served(grad_call) == 0 and "Addmm" in type(result.grad_fn).__name__
    assert served(grad_call) == 1 and "Addmm" in type(result.grad_fn).__name__

    class Sub(torch.Tensor):
        pass

    with torch.no_grad():
        assert served(lambda: kernels.linear(x.as_subclass(Sub), layer.weight, layer.bias)) == 0
        seen = []

        class Mode(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))

        with Mode():
            assert served(lambda: kernels.linear(x, layer.weight, layer.bias)) == 0
        assert seen

    x32, w32 = torch.randn(4, 16), torch.randn(8, 16)
    out32, hits = warm(x32, w32, torch.randn(8))
    assert hits == 0 and out32.dtype == torch.float32


def test_cpu_fallback_entries_are_served_too(fast, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")             # CPU tensors: torch computes, nothing is tuned
    x, w, bias = torch.randn(3, 5, 16).half(), torch.randn(8, 16).half(), torch.randn(8).half()
    out, hits = warm(x, w, bias, "silu")
    assert hits == 1 and api._fast.module.kind(linear_key(x, w, bias, "silu")) == api._FAST_ADDMM_KIND
    torch.testing.assert_close(out, python_path(x, w, bias, "silu"), rtol=0, atol=0)
    out, hits = warm(x, w)
    assert hits == 1 and api._fast.module.kind(linear_key(x, w)) == 0     # no epilogue: at::mm
    torch.testing.assert_close(out, python_path(x, w), rtol=0, atol=0)


def test_linear_entries_survive_a_reload_and_a_shrink(fast, monkeypatch):
    monkeypatch.setenv("KERNELS_FASTPATH", "off")
    x, w, bias = torch.randn(4, 16).half(), torch.randn(8, 16).half(), torch.randn(8).half()
    kernels.linear(x, w, bias, activation="gelu")
    assert api._fast_call is None
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    kernels.mm(torch.randn(3, 8).half(), torch.randn(8, 4).half())     # a cold call loads the library
    assert served(lambda: kernels.linear(x, w, bias, activation="gelu")) == 1

    kernels.config.max_problems = 4
    shapes = [(m, 16) for m in range(5, 9)]
    for shape in shapes:                                    # the fourth new problem shrinks the tables to 2
        kernels.linear(torch.randn(shape).half(), w, bias)
    assert len(api._dispatch) <= 4 and api._fast.module.size() == len(api._dispatch)
    last = torch.randn(shapes[-1]).half()
    assert served(lambda: kernels.linear(last, w, bias)) == 1


def test_memory_hits_count_table_hits_and_clear_empties_it(fast):
    x, w = torch.randn(4, 16).half(), torch.randn(8, 16).half()
    kernels.linear(x, w, activation="relu")
    hits = kernels.stats()["memory_hits"]
    kernels.linear(x, w, activation="relu")
    assert kernels.stats()["memory_hits"] == hits + 1
    kernels.clear_memory_cache()
    assert api._fast.module.size() == 0


@pytest.mark.skipif(not interpret_mode(), reason="Triton winners on CPU need TRITON_INTERPRET=1")
def test_triton_winner_is_called_through_its_launcher(fast):
    kernels.config.backends = ("triton",)
    kernels.config.only = (r"^triton_mm_fp16_32x16x16_s1_",)
    x, w, bias = torch.randn(3, 7, 33).half(), torch.randn(9, 33).half(), torch.randn(9).half()
    out, hits = warm(x, w, bias, "silu")
    assert kernels.explain(x, w, op="linear", bias=bias, activation="silu").winner.startswith("triton_mm_")
    assert hits == 1 and out.shape == (3, 7, 9)
    assert api._fast.module.kind(linear_key(x, w, bias, "silu")) == api._FAST_PYTHON_KIND
    torch.testing.assert_close(out, python_path(x, w, bias, "silu"), rtol=0, atol=0)
    torch.testing.assert_close(out, reference(x, w, bias, "silu"), rtol=2e-3, atol=2e-3)


# -- native launches with a bias: on CPU nothing launches, so these check the plumbing up to the launch -------------

def native(module, fallback, bias: bool, m=4, n=8):
    """A NativeLaunch of one step taking a, b, out (and the bias), for cuda:0; never launched on CPU tensors."""
    operands = [(0, 0), (1, 1), (2, 2)] + ([(3, 3)] if bias else [])
    step = (1, 1, 1, 1, 128, 0, [0] * (len(operands) + 2), operands)
    return module.native(0, 0, m, n, torch.float16, [step], fallback, ())


def test_native_launch_with_a_bias_takes_it_as_its_third_operand(fast):
    kernels.linear(torch.randn(2, 4).half(), torch.randn(3, 4).half())          # loads the library
    module = api._fast.module
    calls = []

    def fallback(*args):
        calls.append(args)
        return torch.zeros(4, 8).half()

    with_bias = native(module, fallback, bias=True)
    assert "+ bias" in repr(with_bias)
    a, b, bias, out = torch.randn(4, 16).half(), torch.randn(16, 8).half(), torch.randn(8).half(), None
    with_bias(a, b, bias)                                   # CPU tensors: the Python path runs it
    with_bias(a, b, bias, out)
    assert [len(c) for c in calls] == [4, 4] and calls[0][2] is bias and calls[0][3] is None
    with pytest.raises(TypeError, match="bias, out=None"):
        with_bias(a, b)
    without = native(module, fallback, bias=False)
    without(a, b)
    assert len(calls[-1]) == 3 and calls[-1][2] is None
    with pytest.raises(ValueError, match="0\\.\\.5"):
        module.native(0, 0, 4, 8, torch.float16, [(1, 1, 1, 1, 128, 0, [0, 0], [(0, 6)])], fallback, ())


def test_native_entry_must_match_its_key_and_is_served_through_its_fallback_on_cpu(fast):
    x, w, bias = torch.randn(2, 2, 16).half(), torch.randn(8, 16).half(), torch.randn(8).half()
    kernels.linear(x, w, bias, activation="relu")
    module = api._fast.module
    seen = []

    def fallback(a, b, c, out):
        seen.append((a.shape, b.shape, c is bias, out))
        return torch.relu(torch.addmm(c, a, b))

    key = linear_key(x, w, bias, "relu")
    with pytest.raises(ValueError, match="cannot compute"):
        module.add(key, api._FAST_PYTHON_KIND, native(module, fallback, bias=False))
    with pytest.raises(ValueError, match="cannot compute"):
        module.add(key, 0, torch.mm)                        # at::mm has no epilogue
    assert module.add(key, api._FAST_PYTHON_KIND, native(module, fallback, bias=True)) is True
    assert module.kind(key) == 3
    out = None

    def call():
        nonlocal out
        out = kernels.linear(x, w, bias, activation="relu")

    assert served(call) == 1 and out.shape == (2, 2, 8)
    assert seen == [((4, 16), (16, 8), True, None)]
    torch.testing.assert_close(out, reference(x, w, bias, "relu"), rtol=2e-3, atol=2e-3)
