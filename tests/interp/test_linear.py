"""kernels.linear end to end on CPU through the tuner (TRITON_INTERPRET=1): F.linear's semantics with the epilogue
fused, 3-D and non-contiguous inputs, a warm second call served from memory."""
import pytest
import torch
import torch.nn.functional as F

import kernels

ACT = {None: lambda z: z, "relu": torch.relu, "gelu": lambda z: F.gelu(z, approximate="tanh"), "silu": F.silu}


def expected(x, w, b, activation):
    return ACT[activation](F.linear(x.double(), w.double(), None if b is None else b.double()))


@pytest.fixture(autouse=True)
def small_space(monkeypatch):
    monkeypatch.setenv("KERNELS_BACKENDS", "aten,triton")
    kernels.config.reset()
    kernels.config.benchmark_space = 1          # the performance model's top pick per backend: a fast tune


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "silu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_matches_torch(activation, dtype):
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 3, 32).to(dtype), torch.randn(24, 32).to(dtype), torch.randn(24).to(dtype)
    for bias in (None, b):
        out = kernels.linear(x, w, bias, activation=activation)
        assert out.shape == (2, 3, 24) and out.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), expected(x, w, bias, activation), rtol=tol, atol=tol)


def test_warm_call_is_served_from_memory_and_flattens_without_copy():
    x, w, b = torch.randn(4, 5, 16), torch.randn(8, 16), torch.randn(8)
    first = kernels.linear(x, w, b, activation="relu")
    before = kernels.stats()
    second = kernels.linear(x, w, b, activation="relu")
    after = kernels.stats()
    assert torch.equal(first, second)
    assert after["tunes"] == before["tunes"] and after["memory_hits"] == before["memory_hits"] + 1


def test_non_contiguous_x_and_bias():
    x = torch.randn(16, 40)[:, ::2]                 # (16, 20), strided rows: flattened with one copy
    w, b = torch.randn(12, 20), torch.randn(24)[::2]
    for _ in range(2):                               # cold, then warm
        out = kernels.linear(x, w, b, activation="silu")
        torch.testing.assert_close(out.double(), expected(x, w, b, "silu"), rtol=1e-4, atol=1e-4)


def test_1d_input_gives_1d_output():
    x, w = torch.randn(16), torch.randn(8, 16)
    out = kernels.linear(x, w)
    assert out.shape == (8,)
    torch.testing.assert_close(out.double(), expected(x, w, None, None), rtol=1e-4, atol=1e-4)


def test_triton_candidates_run_the_epilogue():
    """The tune times Triton tiles beside aten_addmm on an epilogue problem, and they pass verification."""
    x, w, b = torch.randn(16, 32), torch.randn(16, 32), torch.randn(16)
    kernels.linear(x, w, b, activation="gelu")
    sel = kernels.explain(x, w, op="linear", bias=b, activation="gelu")
    assert sel.problem.epilogue == "bias+gelu"
    timed = {n for n, v in sel.timings.items() if isinstance(v, float)}
    assert "aten_addmm" in timed and any(n.startswith("triton") for n in timed), sel.timings
