"""triton_kmajor_int8_mm: int8 with an N-major B, through a K-major copy (interpreter on CPU; GPU in gpu tests)."""
import pytest
import torch

from backends.triton_templates import family
from backends.triton_templates.kmajor import MIN_M, inner_problem, kmajor_ld
from kernels.core.config import interpret_mode
from tests.helpers import problem
from tests.triton_helpers import build_offered, check_launches, operand

interpreted = pytest.mark.skipif(not interpret_mode(), reason="needs TRITON_INTERPRET=1 (set on machines without CUDA)")
TEMPLATE = "triton_kmajor_int8_mm"


def offered(p):
    return family(TEMPLATE).choices(p, TEMPLATE, "default")


def test_offered_for_aligned_n_major_b_with_enough_rows():
    p = problem(m=1024, n=4096, k=4096, dtype="int8", op="int_mm")
    choices, skipped = offered(p)
    assert choices and not skipped
    inner = inner_problem(p)
    assert inner.layout_b == "col" and inner.stride_b == (1, 4096) and inner.stride_a == p.stride_a


def test_not_offered_where_it_cannot_pay():
    k_major = problem(m=1024, n=4096, k=4096, dtype="int8", op="int_mm", stride_b=(1, 4096))
    assert "K-major" in offered(k_major)[1][TEMPLATE]
    skinny = problem(m=MIN_M - 1, n=4096, k=4096, dtype="int8", op="int_mm")
    assert "M=" in offered(skinny)[1][TEMPLATE]
    ragged = problem(m=1024, n=4095, k=4095, dtype="int8", op="int_mm")
    assert "misaligned" in offered(ragged)[1][TEMPLATE]


def test_copy_rows_are_16_byte_aligned():
    assert kmajor_ld(problem(m=64, n=64, k=100, dtype="int8", op="int_mm")) == 112
    assert kmajor_ld(problem(m=64, n=64, k=4096, dtype="int8", op="int_mm")) == 4096


@interpreted
@pytest.mark.parametrize("m,n,k,ldb", [(64, 48, 96, 48), (70, 32, 208, 32), (96, 64, 48, 80)])
def test_matches_torch_on_repeated_calls_and_into_out(m, n, k, ldb):
    a = operand(m, k, "row", torch.int8)
    b = torch.randint(-128, 128, (k, ldb), dtype=torch.int8)[:, :n]      # row-major, maybe with a longer row
    for outcome in build_offered(TEMPLATE, a, b, limit=2, require=True):
        # the K-major copy is reused between calls; assert_close also checks the int32 result dtype
        check_launches(outcome.runner, a, b, calls=2, out_pad=16)
