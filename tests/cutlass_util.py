"""Shared helpers for the CUTLASS tests: problems described without tensors."""
from kernels.core.problem import GemmProblem


def strides(rows: int, cols: int, layout: str) -> tuple[int, int]:
    return (cols, 1) if layout == "row" else (1, rows)


def problem(m=4096, n=4096, k=4096, dtype="bf16", la="row", lb="row", align_a=16, align_b=16, arch=90,
            stride_a=None, stride_b=None) -> GemmProblem:
    op = "int_mm" if dtype == "int8" else "mm"
    return GemmProblem(op=op, m=m, n=n, k=k, dtype=dtype, out_dtype="int32" if op == "int_mm" else dtype,
                       stride_a=stride_a or strides(m, k, la), stride_b=stride_b or strides(k, n, lb),
                       align_a=align_a, align_b=align_b, device="cuda" if arch else "cpu", arch=arch,
                       device_name="test")
