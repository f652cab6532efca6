"""kernels.linear: bad input names the argument; the epilogue is part of a problem's identity, and plain products
keep the stored keys they had before epilogues existed."""
import json

import pytest
import torch

import kernels
from kernels.core.problem import GemmProblem
from kernels.measure.verify import make_inputs, reference
from kernels.store.schema import _problem


def t(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("args,kwargs,exc,text", [
    ((t(3, 4), t(5, 4, 1)), {}, ValueError, "weight must be 2-D"),
    ((t(3, 4), t(5, 6)), {}, ValueError, "x's last dimension is 4 but weight has in_features 6"),
    ((t(3, 4), t(5, 4), t(4)), {}, ValueError, r"bias must have shape \(5,\)"),
    ((t(3, 4), t(5, 4), t(5, dtype=torch.float16)), {}, TypeError, "bias has dtype torch.float16"),
    ((t(3, 4), t(5, 4)), {"activation": "tanh"}, ValueError, "unknown activation 'tanh'"),
    ((t(3, 4), t(5, 4)), {"activation": 3}, TypeError, "activation must be None or a string"),
    ((t(3, 4, dtype=torch.float64), t(5, 4, dtype=torch.float64)), {}, TypeError, "x has unsupported dtype"),
    ((t(3, 4), t(5, 4, dtype=torch.float16)), {}, TypeError, "x and weight dtypes differ"),
    (([[1.0]], t(5, 4)), {}, TypeError, "x must be a torch.Tensor"),
    ((t(3, 4), t(5, 4), [1.0] * 5), {}, TypeError, "bias must be a torch.Tensor or None"),
    ((torch.tensor(1.0), t(5, 1)), {}, ValueError, "x must have at least one dimension"),
])
def test_linear_rejects_bad_inputs(args, kwargs, exc, text):
    with pytest.raises(exc, match=text):
        kernels.linear(*args, **kwargs)


def test_zero_size_linear_is_the_bias_then_the_activation():
    b = torch.tensor([-1.0, 2.0])
    out = kernels.linear(t(3, 0), t(2, 0), b, activation="relu")
    assert torch.equal(out, torch.tensor([[0.0, 2.0]] * 3))
    assert kernels.linear(t(0, 4), t(2, 4)).shape == (0, 2)
    assert kernels.linear(t(2, 0, 4), t(2, 4)).shape == (2, 0, 2)


def test_plain_problem_key_has_no_epilogue_fields():
    p = GemmProblem.from_tensors("mm", t(8, 4), t(4, 6))
    assert "bias" not in json.loads(p.key()) and "activation" not in json.loads(p.key())
    q = GemmProblem.from_tensors("mm", t(8, 4), t(4, 6), bias=True, activation="gelu")
    assert q.key() != p.key() and q.epilogue == "bias+gelu" and q.short().endswith("bias+gelu")
    assert GemmProblem.from_dict(json.loads(q.key())) == q
    assert GemmProblem.from_dict(json.loads(p.key())) == p


def test_schema_checks_epilogue_fields():
    p = json.loads(GemmProblem.from_tensors("mm", t(8, 4), t(4, 6), bias=True, activation="silu").key())
    p["dynamic"] = list(p["dynamic"])
    assert _problem(p) is None
    assert "activation" in _problem({**p, "activation": "tanh"})
    assert "bias" in _problem({**p, "bias": "yes"})


@pytest.mark.parametrize("activation", ["", "relu", "gelu", "silu"])
def test_reference_applies_the_epilogue(activation):
    p = GemmProblem.from_tensors("mm", t(8, 4), t(4, 6), bias=True, activation=activation)
    a, b, bias = make_inputs(p, "cpu", seed=3)
    assert bias.shape == (6,) and bias.is_contiguous()
    z = a.double() @ b.double() + bias.double()
    want = {"": z, "relu": torch.relu(z), "silu": torch.nn.functional.silu(z),
            "gelu": torch.nn.functional.gelu(z, approximate="tanh")}[activation]
    assert torch.allclose(reference(p, a, b, bias), want, rtol=1e-12, atol=1e-12)
