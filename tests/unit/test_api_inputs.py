"""Every bad input gets a clear TypeError/ValueError naming the problem; zero-size dims need no tuning."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernels
from kernels.dispatch import api
from kernels.core.errors import InputTypeError, InputValueError


def t(*shape, dtype=torch.float16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("a,b,exc,text", [
    (t(2, 3, 4), t(4, 5), ValueError, "a must be 2-D, got 3-D"),
    (t(3, 4), t(4), ValueError, "b must be 2-D, got 1-D"),
    (t(3, 4), t(5, 6), ValueError, "inner dimensions differ"),
    (t(3, 4), t(4, 5, dtype=torch.float32), TypeError, "dtypes differ"),
    (t(3, 4, dtype=torch.float64), t(4, 5, dtype=torch.float64), TypeError, "supported: float16, bfloat16, float32"),
    (torch.ones(3, 4, dtype=torch.int8), torch.ones(4, 5, dtype=torch.int8), TypeError, "kernels.int_mm"),
    ([[1.0]], t(1, 1), TypeError, "a must be a torch.Tensor, got list"),
])
def test_mm_rejects_bad_inputs(a, b, exc, text):
    with pytest.raises(exc, match=text):
        kernels.mm(a, b)


def test_int_mm_rejects_floats():
    with pytest.raises(TypeError, match="must be int8, got torch.float16"):
        kernels.int_mm(t(32, 32), t(32, 32))


def test_errors_are_typed_and_catchable_as_builtins():
    with pytest.raises(InputValueError):
        kernels.mm(t(3, 4), t(5, 6))
    with pytest.raises(InputTypeError):
        kernels.mm(t(3, 4), t(4, 5, dtype=torch.bfloat16))


def test_devices_differ():
    meta = torch.empty(4, 5, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="different devices"):
        kernels.mm(t(3, 4), meta)


@pytest.mark.parametrize("out,exc,text", [
    (torch.empty(3, 6, dtype=torch.float16), ValueError, r"out has shape \(3, 6\), expected \(3, 5\)"),
    (torch.empty(3, 5, dtype=torch.float32), TypeError, "out has dtype torch.float32, expected torch.float16"),
    (torch.empty(3, 5, dtype=torch.float16, device="meta"), ValueError, "out is on meta"),
    ("nope", TypeError, "out must be a torch.Tensor"),
])
def test_bad_out(out, exc, text):
    with pytest.raises(exc, match=text):
        kernels.mm(t(3, 4), t(4, 5), out=out)


def test_an_out_sharing_memory_with_an_input_is_refused():
    """out written over an input makes the kernel read what it already wrote: a wrong result without an error (torch's
    CPU mm too). Refused, naming which input; an out apart from them in the same buffer is fine (a new user's probe)."""
    x, w = t(5, 5), t(5, 5)
    with pytest.raises(ValueError, match="out shares memory with a"):
        kernels.mm(x, w, out=x)
    with pytest.raises(ValueError, match="out shares memory with b"):
        kernels.mm(x, w, out=w.t())
    base = t(10, 5)
    a, out = base[:5], base[5:]
    want = a.float() @ w.float()
    assert kernels.mm(a, w, out=out) is out
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    # column blocks of one buffer (torch.mm takes them): apart, fine; meeting, refused
    buf = t(5, 10)
    a, out = buf[:, :5], buf[:, 5:]
    want = a.float() @ w.float()
    assert kernels.mm(a, w, out=out) is out
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="out shares memory with a"):
        kernels.mm(buf[:, :5], w, out=buf[:, 4:9])
    cbuf = t(10, 5).t()                 # column-major (5, 10): its column blocks are the transposes' row blocks
    with pytest.raises(ValueError, match="out shares memory with a"):
        kernels.mm(cbuf[:, :5], w, out=cbuf[:, 2:7])
    from kernels.dispatch.out_arg import overlaps
    assert not overlaps(cbuf[:, 5:], cbuf[:, :5]) and not overlaps(buf[::2], buf[1::2])
    assert overlaps(buf[:, ::2], buf[:, 1::2])      # columns taking turns: not checked element by element, refused
    with pytest.raises(TypeError, match=r"a must be int8, got torch.uint8$"):
        kernels.int_mm(torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.int8))


def test_zero_size_dims_need_no_tuning():
    before = kernels.stats()["tunes"]
    assert kernels.mm(t(0, 4), t(4, 5)).shape == (0, 5)
    assert kernels.mm(t(3, 4), t(4, 0)).shape == (3, 0)
    z = kernels.mm(t(3, 0), t(0, 5))
    assert z.shape == (3, 5) and bool((z == 0).all())
    out = torch.full((3, 5), 7, dtype=torch.int32)
    kernels.int_mm(torch.ones(3, 0, dtype=torch.int8), torch.ones(0, 5, dtype=torch.int8), out=out)
    assert bool((out == 0).all())
    assert kernels.explain(t(3, 0), t(0, 5)).source == "trivial"
    assert kernels.stats()["tunes"] == before


def test_autograd_inputs_get_gradients():
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(4, 8, generator=gen, requires_grad=True)
    b = torch.randn(8, 3, generator=gen)
    c = kernels.mm(a, b)
    c.sum().backward()
    # fp32 tolerances: a row sum of b may cancel to ~0, where allclose's default atol (1e-8) failed now and then
    assert a.grad is not None
    torch.testing.assert_close(a.grad, b.sum(1).expand(4, 8))


def test_explain_refuses_arguments_its_op_does_not_take():
    """bias / activation describe op="linear" and the scales op="scaled_mm": given with another op they would be
    dropped without a word, so they are an error naming the op."""
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with pytest.raises(InputValueError, match="bias and activation describe op='linear'"):
        kernels.explain(a, b, op="mm", bias=torch.randn(4))
    with pytest.raises(InputValueError, match="bias and activation describe op='linear'"):
        kernels.explain(a, b, activation="relu")
    with pytest.raises(InputValueError, match="scale_a and scale_b describe op='scaled_mm'"):
        kernels.explain(a, b.t(), op="linear", scale_a=torch.ones(()))


def test_a_non_string_activation_and_a_non_path_preload_are_type_errors():
    with pytest.raises(InputTypeError, match="activation must be None or a string"):
        kernels.linear(torch.randn(2, 8), torch.randn(4, 8), activation=1)
    with pytest.raises(InputTypeError, match="preload: problems must be a path or a list of paths"):
        kernels.preload(problems=5)
    assert kernels.preload(problems=iter([])).loaded == 0        # any iterable of paths, a generator too


def test_torch_func_transforms_pass_through_to_torch():
    """vmap / grad wrap operands without storage: kernels.mm, kernels.linear, a patched model and enabled() hand such
    calls to torch (which batches and differentiates them), counted, instead of failing on the data pointer."""
    torch.manual_seed(0)
    x, b, w = torch.randn(3, 16, 32), torch.randn(32, 8), torch.randn(8, 32)
    torch.testing.assert_close(torch.vmap(lambda xi: kernels.mm(xi, b))(x), x @ b)
    torch.testing.assert_close(torch.vmap(lambda xi: kernels.linear(xi, w, activation="relu"))(x), F.relu(x @ w.t()))
    model = kernels.patch(torch.nn.Sequential(torch.nn.Linear(32, 8)))
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = torch.func.vmap(torch.func.grad(lambda p, xi: torch.func.functional_call(model, p, (xi,)).sum()),
                                 in_dims=(None, 0))(params, x[0])
    torch.testing.assert_close(per_sample["0.weight"], x[0][:, None, :].expand(16, 8, 32))
    with kernels.enabled():
        torch.testing.assert_close(torch.vmap(lambda xi: F.linear(xi, w))(x), x @ w.t())
    assert kernels.stats()["passthrough:functorch"] >= 4


def test_int_mm_on_the_cpu_fallback_is_exact_for_broadcast_operands(monkeypatch):
    """torch's CPU _int_mm misreads a stride of 0 (an expand): the fallback copies such operands first."""
    monkeypatch.setattr(api, "_cpu_fallback", lambda like: True)
    torch.manual_seed(0)
    a, b = torch.randint(-128, 128, (16, 32), dtype=torch.int8), torch.randint(-128, 128, (32, 8), dtype=torch.int8)
    a_row, b_col = a[:1].expand(16, 32), b[:, :1].expand(32, 8)
    for x, y in ((a_row, b), (a, b_col), (a_row, b_col)):
        want = (x.long() @ y.long()).int()
        assert torch.equal(kernels.int_mm(x, y), want) and torch.equal(kernels.int_mm(x, y), want)


def test_a_bad_setting_fails_the_first_call_even_when_nothing_is_tuned(monkeypatch):
    """Settings are checked at the process's first cold call, not only when a problem is tuned: a warm cache (here
    the CPU fallback, which tunes nothing) used to serve a typo silently until a new shape came mid-run."""
    monkeypatch.setattr(api, "_cpu_fallback", lambda like: True)
    monkeypatch.setattr(api, "_settings_checked", False)
    monkeypatch.setenv("KERNELS_BENCH_MS", "abc")
    with pytest.raises(ValueError, match="KERNELS_BENCH_MS='abc' is not valid"):
        kernels.mm(t(4, 8), t(8, 4))
    monkeypatch.delenv("KERNELS_BENCH_MS")
    kernels.mm(t(4, 8), t(8, 4))
    assert api._settings_checked


def test_an_out_whose_elements_share_memory_is_refused():
    a, b = t(16, 8), t(8, 8)
    with pytest.raises(ValueError, match="out has elements that share memory"):
        kernels.mm(a, b, out=torch.empty(1, 8, dtype=torch.float16).expand(16, 8))
    out = torch.empty(1, 8, dtype=torch.float16).expand(1, 8)          # one row: nothing shared
    torch.testing.assert_close(kernels.mm(a[:1], b, out=out), a[:1].float().mm(b.float()).half())



def test_autocast_leaves_meta_tensors_to_the_usual_checks():
    """torch.is_autocast_enabled("meta") raises: a patched model built on the meta device still falls back to torch
    under autocast, and kernels.mm names the device as before."""
    with torch.device("meta"):
        model = torch.nn.Linear(16, 8)
    kernels.patch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.empty(4, 16, device="meta")).shape == (4, 8)
        with pytest.raises((TypeError, ValueError)):
            kernels.mm(torch.empty(4, 16, device="meta"), torch.empty(16, 8, device="meta"))


def test_a_winner_resolved_before_a_clear_is_not_registered_after_it(monkeypatch):
    """kernels.clear_memory_cache (what a selection setting's change calls) during a cold call: the call returns
    its product, but its winner, chosen before the change, does not enter the warm table."""
    monkeypatch.setattr(api, "_cpu_fallback", lambda like: False)
    real = api._record.resolve

    def resolve_then_clear(*args, **kwargs):
        launch = real(*args, **kwargs)
        kernels.clear_memory_cache()
        return launch

    monkeypatch.setattr(api._record, "resolve", resolve_then_clear)
    a, b = t(8, 16), t(16, 8)
    torch.testing.assert_close(kernels.mm(a, b), (a.float() @ b.float()).half(), rtol=1e-2, atol=1e-2)
    assert api._dispatch.get(api._fast_key("mm", a, b)) is None


@pytest.mark.parametrize("make,text", [
    (lambda: kernels.Dynamic("m", hints=16), "size hints must be a list of positive integers, got 16"),
    (lambda: kernels.Dynamic(dims=5), "dynamic dims must be 'm', 'm,k'"),
    (lambda: kernels.Dynamic("m", hints=[True, 64]), "size hints must be positive integers, got True"),
    (lambda: setattr(kernels.config, "only", 5), "got type int; allowed: a comma list"),
    (lambda: setattr(kernels.config, "dynamic", kernels.Dynamic("m")), "a kernels.Dynamic goes to mm's dynamic="),
    (lambda: kernels.preload([1, 2]), r"preload: problems must be a path or a list of paths .* holds a int \(1\)"),
])
def test_odd_values_are_errors_that_say_what_is_allowed(make, text):
    """Values a new user tried that raised Python's own TypeErrors ('int' object is not iterable): each is an error
    of ours saying what was expected (a new user's probe)."""
    with pytest.raises((TypeError, ValueError), match=text):
        make()


def test_explain_refuses_arguments_its_op_does_not_take():
    """explain(op="mm", out_dtype=...) and explain(op="linear", dynamic=...) ignored them silently, and op="scaled_mm"
    without scales answered in kernels.scaled_mm's words, naming no explain argument (a new user's probe)."""
    a, b = t(3, 4), t(4, 5)
    with pytest.raises(ValueError, match="explain: out_dtype describes op='scaled_mm', not op='mm'"):
        kernels.explain(a, b, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="explain: kernels.linear's problems are never dynamic"):
        kernels.explain(a, b.t(), op="linear", dynamic="m")
    for static in ("", (), False):          # documented as static: taken
        assert kernels.explain(a, b.t(), op="linear", dynamic=static).winner
    with pytest.raises(ValueError, match="explain: op='scaled_mm' needs scale_a= and scale_b="):
        kernels.explain(a, b, op="scaled_mm")


def test_the_cpu_fallbacks_explain_says_nothing_was_timed(monkeypatch):
    """Computed by torch on the CPU, nothing was timed: its table said "burst final round" (a new user's probe)."""
    from kernels.dispatch import api

    monkeypatch.setattr(api, "interpret_mode", lambda: False)       # the CPU without the Triton interpreter
    table = kernels.explain(torch.randn(4, 4), torch.randn(4, 4)).table()
    assert "(cpu-fallback, nothing timed," in table and "final round" not in table


def _addresses(view: torch.Tensor) -> set[int]:
    rows, cols = view.shape
    return {view.data_ptr() + (r * view.stride(0) + c * view.stride(1)) * view.element_size()
            for r in range(rows) for c in range(cols)}


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 7), st.integers(1, 8), st.integers(0, 11), st.integers(1, 12), st.integers(1, 2),
       st.integers(0, 7), st.integers(1, 8), st.integers(0, 11), st.integers(1, 12), st.integers(1, 2),
       st.booleans())
def test_the_overlap_check_never_misses_and_is_exact_for_blocks(r0, nr, c0, nc, cs, r1, mr, c1, mc, ds, transpose):
    """kernels.dispatch.out_arg.overlaps against the elements' addresses, over views of one 8x12 buffer: it never
    says apart where they meet, and for row/column blocks (unit stride along the row) it is exact."""
    from kernels.dispatch.out_arg import overlaps

    buf = torch.zeros(8, 12, dtype=torch.float16)
    x = buf[r0:r0 + nr, c0:c0 + nc:cs]
    y = buf[r1:r1 + mr, c1:c1 + mc:ds]
    if transpose:
        x, y = x.t(), y.t()
    meet = bool(_addresses(x) & _addresses(y))
    assert overlaps(x, y) or not meet
    if cs == ds == 1 and x.numel() and y.numel():
        assert overlaps(x, y) == meet
