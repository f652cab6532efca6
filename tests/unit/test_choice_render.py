import ast

from backends.triton_render import render
from backends.triton_templates import family
from kernels.core.choice import Choice
from kernels.space.heuristics import GemmConfig
from tests.helpers import problem


def test_choice_names_are_stable_identities():
    cfg = GemmConfig(128, 128, 64, 3, 4)
    assert Choice("triton", "triton_mm", "bf16", cfg).name == "triton_mm_bf16_128x128x64_s3_w4_g8"
    assert Choice("triton", "triton_int8_mm", "int8", cfg).name == "triton_int8_mm_128x128x64_s3_w4_g8"
    assert Choice("aten", "aten_mm", "bf16").name == "aten_mm"
    c = Choice("triton", "triton_mm", "fp16", cfg, (("split", 4),))
    assert c.name.endswith("_split4") and Choice.from_dict(c.as_dict()) == c


def _render(p, cfg=GemmConfig(64, 64, 32, 3, 4)):
    choice = Choice("triton", "triton_int8_mm" if p.dtype == "int8" else "triton_mm", p.dtype, cfg)
    (spec,) = family(choice.template).specs(p, choice)
    return spec, render(spec)


def test_row_major_operands_bake_unit_strides_and_even_k():
    spec, src = _render(problem(k=4096))
    ast.parse(src)
    assert spec.var("even_k") and spec.var("a_layout") == "row" and spec.var("b_layout") == "row"
    assert "rk[None, :] * 1" in src and "rn[None, :] * 1" in src
    assert "EVEN_K: tl.constexpr = True" in src
    assert "input_precision" not in src and "tl.float32" in src


def test_col_major_and_ragged_k():
    p = problem(m=100, n=50, k=70, stride_a=(1, 100), stride_b=(1, 70))
    spec, src = _render(p)
    assert spec.var("a_layout") == "col" and spec.var("b_layout") == "col" and not spec.var("even_k")
    assert "rm[:, None] * 1" in src and "rk[:, None] * 1" in src
    assert "EVEN_K: tl.constexpr = False" in src
    assert 4 not in spec.div16 and 5 not in spec.div16      # N=50, K=70 are not multiples of 16


def test_precision_and_int8_dot():
    _, src32 = _render(problem(dtype="fp32"))
    assert 'input_precision="tf32"' in src32
    spec8, src8 = _render(problem(dtype="int8", op="int_mm"))
    assert "out_dtype=tl.int32" in src8 and "tl.int32" in src8
    assert spec8.signature["c_ptr"] == "*i32" and spec8.signature["a_ptr"] == "*i8"


def test_a_choice_whose_name_is_not_an_identifier_never_renders():
    """A choice's name becomes the kernel's name in the source: one spelled from a parameter that is not what a
    template takes (a hand-written selection or table) is refused before anything is rendered."""
    import pytest

    cfg = GemmConfig(64, 64, 32, 3, 4)
    evil = Choice("triton", "triton_mm", "fp16", cfg, (("x", "(a):pass\nimport os\ndef z"),))
    with pytest.raises(ValueError, match="not a plain identifier"):
        family(evil.template).specs(problem(dtype="fp16"), evil)
