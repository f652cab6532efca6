"""The fused blocks' compiled launches (backends.fused_triton): a binary is compiled per specialisation key and
assumes only what the key holds, so two calls with one key can share a binary and a call never gets a binary compiled
for facts (alignment, a multiple of 16) its own arguments lack."""
import torch

from backends import fused_triton as ft


def _norm_args(x, width=None):
    width = width or x.shape[1]
    rows = x.shape[0]
    y = torch.empty(rows, width, dtype=x.dtype)
    return (x, torch.ones(width, dtype=x.dtype), y, torch.empty(rows), x.stride(0), width, width, 1e-6)


def _backward_args(rows, width=64, dtype=torch.bfloat16):
    t = torch.randn(rows, width, dtype=dtype)
    programs = min(rows, 4)
    return (t, t, torch.ones(width, dtype=dtype), torch.empty(rows), torch.empty_like(t),
            torch.zeros(programs, width), width, width, width, rows, width, -(-rows // programs))


def _key_and_signature(args, kernel):
    return ft.specialisation_key(args, kernel), ft.signature(args, kernel)


def test_rows_and_element_counts_are_never_assumed():
    for rows in (16, 32, 48, 7):
        key, (types, div16) = _key_and_signature(_backward_args(rows), ft.RMSNORM_BACKWARD)
        assert key == ft.specialisation_key(_backward_args(64), ft.RMSNORM_BACKWARD)
        assert 9 not in div16 and 11 not in div16           # M and rows_per_program: never multiples of 16
        assert types["M"] == "i32" and types["BLOCK"] == "constexpr"

def test_element_counts_are_assumed_multiples_of_16_only_when_they_are():
    def swiglu_args(rows, width):
        g = torch.randn(rows, width, dtype=torch.bfloat16)
        return (g, g, torch.empty_like(g), g.numel())

    key, (_, div16) = _key_and_signature(swiglu_args(32, 64), ft.SWIGLU_FORWARD)
    assert 3 in div16
    assert key == ft.specialisation_key(swiglu_args(33, 64), ft.SWIGLU_FORWARD)      # any multiple of 16: one binary
    odd_key, (_, odd_div16) = _key_and_signature(swiglu_args(3, 7), ft.SWIGLU_FORWARD)
    assert odd_key != key and 3 not in odd_div16


def test_a_misaligned_pointer_gets_its_own_key_and_no_alignment():
    base = torch.randn(8, 80, dtype=torch.bfloat16)
    aligned, misaligned = base[:, :64], base[:, 1:65]           # 2 bytes off: not 16-byte aligned
    key_a, (_, div_a) = _key_and_signature(_norm_args(aligned, 64), ft.RMSNORM_FORWARD)
    key_m, (_, div_m) = _key_and_signature(_norm_args(misaligned, 64), ft.RMSNORM_FORWARD)
    assert key_a != key_m
    assert 0 in div_a and 0 not in div_m
    assert 4 in div_a                                           # stride 80: a multiple of 16


def test_a_stride_not_a_multiple_of_16_is_not_assumed_one():
    x = torch.randn(8, 72, dtype=torch.float16)[:, :64]         # row stride 72
    key, (types, div16) = _key_and_signature(_norm_args(x, 64), ft.RMSNORM_FORWARD)
    assert 4 not in div16 and 5 in div16 and 6 in div16        # stride_x 72; stride_y and N 64
    other_odd = torch.randn(8, 88, dtype=torch.float16)[:, :64]
    multiple = torch.randn(8, 80, dtype=torch.float16)[:, :64]
    assert key == ft.specialisation_key(_norm_args(other_odd, 64), ft.RMSNORM_FORWARD)
    assert key != ft.specialisation_key(_norm_args(multiple, 64), ft.RMSNORM_FORWARD)
    assert types == {"x_ptr": "*fp16", "w_ptr": "*fp16", "y_ptr": "*fp16", "rstd_ptr": "*fp32", "stride_x": "i32",
                     "stride_y": "i32", "N": "i32", "eps": "fp32", "BLOCK": "constexpr",
                     "STORE_RSTD": "constexpr"}


def test_every_pointer_and_every_keyed_integer_is_in_the_key():
    for args, kernel in ((_norm_args(torch.randn(4, 64)), ft.RMSNORM_FORWARD),
                         (_backward_args(5), ft.RMSNORM_BACKWARD),
                         ((torch.randn(4, 4),) * 3 + (16,), ft.SWIGLU_FORWARD)):
        key, (types, _) = _key_and_signature(args, kernel)
        pointers = sum(t.startswith("*") for t in types.values())
        assert len(key) == pointers + len(kernel.keyed) + len(kernel.divisible)
        assert all(isinstance(args[i], int) for i in kernel.keyed + kernel.divisible)


def test_a_key_decides_the_signature_and_strides_do_not_multiply_binaries():
    """Over views at every offset and row stride: one key never maps to two signatures, and per dtype and width
    the keys are few (alignments and multiples of 16, not one per stride)."""
    signatures: dict = {}
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for width in (16, 24, 64):
            keys = set()
            for extra in range(0, 40, 3):
                base = torch.randn(6, width + extra + 16, dtype=dtype)
                for offset in range(0, 9):
                    x = base[:, offset:offset + width]
                    args = _norm_args(x, width)
                    key = ft.specialisation_key(args, ft.RMSNORM_FORWARD)
                    signature = ft.signature(args, ft.RMSNORM_FORWARD)
                    assert signatures.setdefault(key, signature) == signature
                    keys.add(key)
            assert len(keys) <= 4           # x aligned or not, its row stride a multiple of 16 or not
