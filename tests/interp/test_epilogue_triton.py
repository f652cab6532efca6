"""Fused bias + activation epilogues in every Triton family that serves mm (the tiled kernel, persistent TMA,
split_k, decompose_k, both padded ones), run by the interpreter on CPU against float64 act(a @ b + bias); and what
their launches look like to the C++ warm-call table. int8 families never get an epilogue (int_mm has none); bf16
is covered by the sm90 compile test (the interpreter's bf16 dot is broken upstream, triton issue #11584)."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from backends.triton import TritonBackend
from backends.triton_launch import CompiledHandle
from backends.triton_templates import family
from kernels.core.choice import Choice
from kernels.core.config import interpret_mode
from kernels.core.problem import GemmProblem
from kernels.measure.verify import check
from kernels.native import fastpath
from kernels.space.heuristics import GemmConfig
from tests.triton_helpers import operand

interpreted = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

# template -> ((m, n, k), config, params): one small choice each. N is not a multiple of the tile (the bias load is
# masked); split_k/decompose_k split K four ways (a bias added per split, or an activation of each partial, would
# be far off); the padded problems are misaligned (K odd) with an odd N, so the bias has the caller's N entries
# while the kernel's B is wider.
FAMILIES = {
    "triton_mm": ((20, 24, 40), GemmConfig(16, 16, 16, 1, 1), ()),
    "triton_tma_mm": ((20, 48, 48), GemmConfig(16, 32, 16, 1, 4), (("sub", 1),)),
    "split_k": ((20, 24, 256), GemmConfig(16, 16, 32, 1, 1), (("split", 4),)),
    "decompose_k": ((8, 24, 256), None, (("split", 4),)),
    "triton_padded_mm": ((20, 23, 37), GemmConfig(16, 16, 16, 1, 1), ()),
    "triton_padded_tma_mm": ((20, 23, 37), GemmConfig(16, 16, 16, 1, 4), ()),
}
ACTIVATIONS = {"": lambda x: x, "relu": F.relu, "gelu": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


def epilogue_problem(a, b, bias: bool, activation: str) -> GemmProblem:
    return dataclasses.replace(GemmProblem.from_tensors("mm", a, b), bias=bias, activation=activation)


def bias_vector(n: int, dtype: torch.dtype) -> torch.Tensor:
    """(N,) contiguous, with NaN stored right after it: a read past N that reached an output would show."""
    return torch.cat([torch.randn(n).to(dtype), torch.full((16,), float("nan"), dtype=dtype)])[:n]


def reference(a, b, bias, activation) -> torch.Tensor:
    acc = a.double() @ b.double()
    if bias is not None:
        acc = acc + bias.double()
    return ACTIVATIONS[activation](acc)


def build(template: str, p: GemmProblem):
    _, cfg, params = FAMILIES[template]
    (outcome,) = TritonBackend().build(p, [Choice("triton", template, p.dtype, cfg, params)])
    assert outcome.runner is not None, outcome.error
    return outcome.runner.launch


@interpreted
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
@pytest.mark.parametrize("template", list(FAMILIES))
def test_epilogue_matches_float64(template, dtype, with_bias, activation):
    torch.manual_seed(0)
    (m, n, k), _, _ = FAMILIES[template]
    a, b = operand(m, k, "row", dtype), operand(k, n, "col", dtype)          # b = weight.t(), as in a linear
    bias = bias_vector(n, dtype) if with_bias else None
    p = epilogue_problem(a, b, with_bias, activation)
    launch = build(template, p)
    operands = (a, b, bias) if with_bias else (a, b)
    ref = reference(a, b, bias, activation)

    result = check(p, launch(*operands, None), ref)
    assert result.ok, result.message
    # a caller's out with longer rows is written in place; a second call also finds split_k's workspace clean
    out = torch.full((m, n + 8), float("nan"), dtype=dtype)[:, :n]
    assert launch(*operands, out) is out
    result = check(p, out, ref)
    assert result.ok, result.message


@interpreted
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("template", ["triton_mm", "split_k"])
def test_epilogue_keeps_nan_and_inf_as_torch_does(template, activation):
    """A NaN in a row of `a` reaches the activation as NaN: relu keeps it (torch's does; tl.maximum gave 0)."""
    (m, n, k), _, _ = FAMILIES[template]
    a, b = operand(m, k, "row", torch.float16), operand(k, n, "col", torch.float16)
    a[0, 0], a[1, 0] = float("nan"), float("inf")
    bias = bias_vector(n, torch.float16)
    launch = build(template, epilogue_problem(a, b, True, activation))
    got, ref = launch(a, b, bias, None).double(), reference(a, b, bias, activation)
    assert torch.equal(got[:2].isnan(), ref[:2].isnan()) and torch.equal(got[:2].isinf(), ref[:2].isinf())
    assert got[0].isnan().all()


class _Handle(CompiledHandle):
    """A compiled-kernel stand-in: launches nothing, offers a native layout."""

    def __init__(self, arg_types):
        self.kernel, self.device_index, self.device, self.arg_types = None, 0, torch.device("cpu"), arg_types

    def bind(self, grid):
        return lambda *args: None

    def native_layout(self):
        return (1, 128, 0, 0), ""


class _FakeTable:
    def native(self, *args):
        return args


@pytest.mark.parametrize("template", list(FAMILIES))
def test_native_launch_describes_the_bias_operand(template, monkeypatch):
    """Every epilogue problem gets its native launch; the bias is operand 3 (Operand.BIAS) of the kernel that
    applies the epilogue, and an activation-only problem's operands are still (a, b, out)."""
    monkeypatch.setenv("KERNELS_FASTPATH", "auto")
    monkeypatch.setattr(fastpath, "_loaded", [_FakeTable()])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    (m, n, k), cfg, params = FAMILIES[template]
    a, b = operand(m, k, "row", torch.float16), operand(k, n, "col", torch.float16)
    for with_bias, activation in ((True, ""), (True, "silu"), (False, "gelu")):
        p = epilogue_problem(a, b, with_bias, activation)
        choice = Choice("triton", template, p.dtype, cfg, params)
        specs = family(template).specs(p, choice)
        # the bias goes to the kernel that applies the epilogue, the last one (not a copy, not decompose_k's partials)
        assert [("bias_ptr" in spec.signature) for spec in specs] == [False] * (len(specs) - 1) + [with_bias]
        handles = [_Handle(tuple(arg.type for arg in spec.args)) for spec in specs]
        launch = family(template).launcher(p, choice, specs, handles)
        assert launch.native_why == "" and launch.direct is launch.native
        steps = launch.native[5]
        operand_codes = [code for step in steps for _, code in step[-1]]
        assert (3 in operand_codes) == with_bias and operand_codes.count(3) <= 1
