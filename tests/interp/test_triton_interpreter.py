"""Triton templates run through the interpreter on CPU tensors, against float64 torch, on odd shapes and layouts.
(bf16 is not covered here: the interpreter's bf16 tl.dot is broken upstream, triton issue #11584; bf16 is covered
by the sm90 compile test and the GPU tests.)"""
import warnings

import pytest
import torch

import kernels
from backends.triton import TritonBackend
from kernels.core.choice import Choice
from kernels.core.config import interpret_mode
from kernels.space.heuristics import GemmConfig
from kernels.core.problem import GemmProblem
from kernels.tune.autotune import NameFilterWarning
from tests.triton_helpers import assert_close, operand

pytestmark = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")

DTYPES = {"fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8}


def run_choice(a, b, cfg):
    op = "int_mm" if a.dtype == torch.int8 else "mm"
    p = GemmProblem.from_tensors(op, a, b)
    template = "triton_int8_mm" if op == "int_mm" else "triton_mm"
    outcome = TritonBackend().build(p, [Choice("triton", template, p.dtype, cfg)])[0]
    assert outcome.runner is not None, outcome.error
    return outcome.runner.launch(a, b, None)


@pytest.mark.parametrize("dtype", ["fp16", "fp32", "int8"])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (17, 33, 65), (128, 1, 300), (40, 50, 64)])
@pytest.mark.parametrize("la,lb", [("row", "row"), ("col", "col"), ("sliced", "row"), ("strided", "col")])
def test_template_matches_torch(dtype, m, n, k, la, lb):
    a, b = operand(m, k, la, DTYPES[dtype]), operand(k, n, lb, DTYPES[dtype])
    cfg = GemmConfig(32, 32, 32, 2, 4)
    assert_close(run_choice(a, b, cfg), a, b)


def test_blocks_larger_than_problem_and_even_k():
    a, b = operand(5, 64, "row", torch.float16), operand(64, 7, "col", torch.float16)
    assert_close(run_choice(a, b, GemmConfig(64, 64, 32, 3, 4)), a, b)


def test_true_fp32_when_precision_is_highest():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        a, b = operand(33, 47, "row", torch.float32), operand(47, 29, "row", torch.float32)
        assert_close(run_choice(a, b, GemmConfig(32, 32, 32, 2, 4)), a, b)
        assert GemmProblem.from_tensors("mm", a, b).precision == "ieee"
    finally:
        torch.set_float32_matmul_precision(old)


def test_out_argument_with_any_layout():
    a, b = operand(20, 48, "row", torch.float16), operand(48, 24, "row", torch.float16)
    kernels.mm(a, b)                       # tune once
    out_t = torch.empty(24, 20, dtype=torch.float16).t()       # column-major out
    res = kernels.mm(a, b, out=out_t)
    assert res is out_t
    assert_close(out_t, a, b)


@pytest.mark.parametrize("la,lb", [("row", "col"), ("sliced", "strided")])
def test_kernels_mm_end_to_end_tunes_and_explains(la, lb):
    a, b = operand(17, 65, la, torch.float16), operand(65, 33, lb, torch.float16)
    c = kernels.mm(a, b)
    assert_close(c, a, b)
    sel = kernels.explain(a, b)
    assert sel.source == "memory"
    assert any(n.startswith("triton_mm_fp16_") for n in sel.timings) and "aten_mm" in sel.timings
    assert isinstance(sel.timings[sel.winner], float)
    assert "AUTOTUNE" in sel.table()
    # where the tune's time went, stage by stage, adds up to no more than the whole
    assert {"candidates", "build", "verify", "first_pass", "final_round"} <= set(sel.stage_seconds)
    assert 0 < sum(sel.stage_seconds.values()) <= sel.tune_seconds
    assert "first_pass" in sel.table().splitlines()[0]


def test_int_mm_end_to_end_including_small_m():
    a, b = operand(8, 64, "row", torch.int8), operand(64, 24, "col", torch.int8)
    assert_close(kernels.int_mm(a, b), a, b)
    sel = kernels.explain(a, b, op="int_mm")
    assert sel.winner.startswith(("triton_int8_mm", "aten_int_mm"))


def test_verbose_prints_autotune_table(capsys):
    kernels.config.verbose = True
    a, b = operand(9, 32, "row", torch.float16), operand(32, 9, "row", torch.float16)
    kernels.mm(a, b)
    assert "AUTOTUNE mm 9x9x32 fp16" in capsys.readouterr().err


def test_a_selection_setting_changed_in_code_is_seen_by_a_problem_already_served():
    # the process's warm table held the winner tuned under the old value, and served it after the change
    a, b = operand(16, 256, "row", torch.float16), operand(256, 16, "row", torch.float16)
    kernels.config.backends = ("triton",)
    kernels.config.only = ("^triton_mm_",)
    assert_close(kernels.mm(a, b), a, b)
    assert kernels.explain(a, b).winner.startswith("triton_mm_")
    kernels.config.only = ("^split_k_",)
    assert_close(kernels.mm(a, b), a, b)
    assert kernels.explain(a, b).winner.startswith("split_k_")
    kernels.config.backends = ("aten",)
    assert_close(kernels.mm(a, b), a, b)
    assert kernels.explain(a, b).winner == "aten_mm"
    tunes = kernels.stats()["tunes"]
    kernels.config.reset()                       # the values set in code forgotten: the problem is selected again
    kernels.mm(a, b)
    assert kernels.stats()["tunes"] == tunes + 1


def test_autocast_casts_the_operands_whatever_wins():
    """Under torch.autocast torch.mm and F.linear run in the autocast dtype; a Triton winner must too (it returned
    fp32 from fp32 operands, where aten's torch.mm cast itself), and the grads reach the fp32 leaves."""
    kernels.config.backends = ("triton",)
    a = operand(16, 32, "row", torch.float32).requires_grad_()
    b, w, bias = operand(32, 8, "row", torch.float32), torch.randn(8, 32), torch.randn(8)
    with torch.autocast("cpu", dtype=torch.float16):
        ref_mm, ref_linear = torch.mm(a, b), torch.nn.functional.linear(a, w, bias)
        got_mm, got_linear = kernels.mm(a, b), kernels.linear(a, w, bias)
    assert kernels.explain(a.detach().half(), b.half()).winner.startswith(("triton", "split_k", "decompose_k"))
    assert got_mm.dtype == ref_mm.dtype == torch.float16 and got_linear.dtype == ref_linear.dtype == torch.float16
    torch.testing.assert_close(got_mm, ref_mm, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_linear, ref_linear, atol=2e-2, rtol=2e-2)
    got_linear.float().sum().backward()
    assert a.grad.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.float16):
        out = torch.empty(16, 8)
        assert kernels.mm(a.detach(), b, out=out) is out         # out= is not cast, as torch.mm's is not


def test_a_name_filter_that_leaves_only_aten_warns_and_still_serves(monkeypatch):
    """KERNELS_ONLY with a typo matches no candidate: the tune times aten alone and says why, once a process."""
    from kernels.tune import autotune

    monkeypatch.setattr(autotune, "_warned_filters", set())
    a, b = operand(16, 64, "row", torch.float16), operand(64, 16, "row", torch.float16)
    kernels.config.backends = ("aten", "triton")
    kernels.config.only = ("^trtion_mm_",)
    with pytest.warns(NameFilterWarning, match=r"KERNELS_ONLY=\^trtion_mm_ matched none of a problem's candidates"):
        assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert sel.winner == "aten_mm" and any("left out by KERNELS_ONLY" in n for n in sel.notes)
    with warnings.catch_warnings():          # once a process per filter
        warnings.simplefilter("error", NameFilterWarning)
        kernels.mm(operand(16, 80, "row", torch.float16), operand(80, 16, "row", torch.float16))
        # a filter that keeps a candidate says nothing; KERNELS_SKIP leaving only aten is taken as meant
        kernels.config.only = ("^triton_mm_fp16_16x16x",)
        kernels.mm(operand(16, 96, "row", torch.float16), operand(96, 16, "row", torch.float16))
        kernels.config.only, kernels.config.skip = (), ("^triton", "^split_k")
        x, y = operand(16, 112, "row", torch.float16), operand(112, 16, "row", torch.float16)
        kernels.mm(x, y)
    assert {c.backend for c in kernels.explain(x, y).choices.values()} == {"aten"}
