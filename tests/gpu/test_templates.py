"""GPU: every Triton template, built directly (not through tuning), against torch over a shape grid that includes
the issue-3 target shapes, with repeated calls (split_k's workspace must stay clean) and a caller's `out`.
`pytest -m gpu` runs every template at the shapes where each is offered (aligned and misaligned, B in both layouts
for int8); `pytest -m gpu_sweep` the rest of the grids."""
import pytest
import torch

from backends.triton_templates import templates
from tests.helpers import gpu_grid
from tests.triton_helpers import build_offered, build_padded, cuda_operand as operand, op_of, rel_err

BF16_SHAPES = [(32, 32, 4096), (32, 32, 32768), (16, 12288, 4096), (16, 4096, 11008), (64, 4096, 11008),
               (2047, 2047, 2047), (1, 1, 1000), (17, 33, 3000), (300, 200, 100), (4096, 4096, 4096)]
INT8_SHAPES = [(32, 32, 4096), (1024, 22016, 4096), (64, 64, 8192), (17, 40, 3008), (200, 4096, 1000)]
BF16_TEMPLATES = [t for t in templates() if t != "triton_int8_mm"]
INT8_TEMPLATES = [t for t in templates() if t != "triton_mm"]
BF16_GRID = [(t, *shape) for shape in BF16_SHAPES for t in BF16_TEMPLATES]
INT8_GRID = [(t, *shape, lb) for lb in ("col", "row") for shape in INT8_SHAPES for t in INT8_TEMPLATES]
# 32x32x4096 is aligned (TMA, split-K, decompose-K offered), 2047^3 is not (padded); at 32x32x4096 with B row-major
# the int8 K-major copy is offered too, at 200x4096x1000 (K not a multiple of 16) the padded int8 choices
BF16_EACH_TEMPLATE = [(t, *shape) for shape in [(32, 32, 4096), (2047, 2047, 2047)] for t in BF16_TEMPLATES]
INT8_EACH_TEMPLATE = [(t, *shape) for shape in [(32, 32, 4096, "row"), (200, 4096, 1000, "col")]
                      for t in INT8_TEMPLATES]
PADDED_GRID = [(dtype, *case) for case in [(2047, 2047, 2047, "row", "row"), (33, 47, 200, "col", "sliced"),
                                           (300, 200, 100, "row", "col")]
               for dtype in (torch.bfloat16, torch.float16, torch.int8)]
PADDED_EACH_DTYPE = [(torch.bfloat16, 2047, 2047, 2047, "row", "row"), (torch.float16, 33, 47, 200, "col", "sliced"),
                     (torch.int8, 300, 200, 100, "row", "col")]


def _check_template(template, a, b, limit=3):
    op = op_of(a)
    for outcome in build_offered(template, a, b, limit):
        for call in range(12 if template == "split_k" else 3):     # split_k: its workspace must stay clean
            c = outcome.runner.launch(a, b, None)
            if op == "int_mm":
                assert c.dtype == torch.int32 and torch.equal(c, torch._int_mm(a, b) if a.shape[0] > 16 else
                                                              (a.double() @ b.double()).int())
            else:
                assert c.shape == (a.shape[0], b.shape[1]) and c.dtype == a.dtype
                assert rel_err(c, a, b) < (2e-3 if a.dtype == torch.float32 else 1e-2), (outcome.choice.name, call)
        out = torch.empty(a.shape[0], b.shape[1] + 8, dtype=c.dtype, device="cuda")[:, :b.shape[1]]
        outcome.runner.launch(a, b, out)
        assert torch.equal(out, c) or rel_err(out, a, b) < 1e-2


@pytest.mark.parametrize("template,m,n,k", gpu_grid(BF16_GRID, BF16_EACH_TEMPLATE))
def test_bf16_template(template, m, n, k):
    _check_template(template, operand(m, k, "row", torch.bfloat16), operand(k, n, "row", torch.bfloat16))


# int8 wgmma reads only K-major B: both paths must be right
@pytest.mark.parametrize("template,m,n,k,lb", gpu_grid(INT8_GRID, INT8_EACH_TEMPLATE))
def test_int8_template(template, m, n, k, lb):
    _check_template(template, operand(m, k, "row", torch.int8), operand(k, n, lb, torch.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("template", templates())
def test_fp16_col_major_and_fp32(template):
    if template == "triton_int8_mm":
        pytest.skip("int8 only")
    _check_template(template, operand(48, 4000, "col", torch.float16), operand(4000, 40, "col", torch.float16))
    _check_template(template, operand(48, 4000, "row", torch.float32), operand(4000, 40, "row", torch.float32))


@pytest.mark.parametrize("dtype,m,n,k,la,lb", gpu_grid(PADDED_GRID, PADDED_EACH_DTYPE))
def test_padded_choices_equal_torch(dtype, m, n, k, la, lb):
    """Every padded choice returns what torch does: same shape, dtype, contiguity, and values (exact for int8)."""
    a, b = operand(m, k, la, dtype), operand(k, n, lb, dtype)
    ref = (a.double() @ b.double())
    for outcome in build_padded(a, b, require_available=True)[0]:
        c = outcome.runner.launch(a, b, None)
        assert c.shape == (m, n) and c.is_contiguous()
        if dtype == torch.int8:
            assert c.dtype == torch.int32 and torch.equal(c.double(), ref)
        else:
            assert c.dtype == dtype and rel_err(c, a, b) < 1e-2


@pytest.mark.gpu_sweep      # the tuning rules' GPU tests capture every finalist of a short problem under -m gpu
@pytest.mark.parametrize("template", ["triton_mm", "split_k", "decompose_k", "triton_tma_mm", "triton_padded_mm",
                                      "triton_padded_tma_mm"])
def test_device_time_capture_leaves_launchers_correct(template):
    """Tuning times host-bound finalists in a CUDA graph: every template must capture, and run right afterwards
    (split_k's workspace is allocated per stream and must stay clean)."""
    from kernels.measure.timing import device_time_ms

    m, n, k = (2047, 2047, 2047) if template.startswith("triton_padded") else (32, 32, 8192)
    a, b = operand(m, k, "row", torch.bfloat16), operand(k, n, "row", torch.bfloat16)
    for outcome in build_offered(template, a, b, 2):
        ms = device_time_ms(lambda i, r=outcome.runner: r.launch(a, b, None), 1)
        assert ms is not None and 0 < ms < 1.0, (outcome.choice.name, ms)
        for _ in range(3):
            assert rel_err(outcome.runner.launch(a, b, None), a, b) < 1e-2, outcome.choice.name
