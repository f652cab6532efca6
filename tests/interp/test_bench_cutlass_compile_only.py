"""bench.compare without a GPU: the CUTLASS column builds its best-ranked candidate for sm90 (compile-only).
~45 s of nvcc on 2 cores; skipped without nvcc, CUTLASS headers or ninja."""
import shutil

import pytest

from backends import get_backend
from bench.columns import Column
from bench.measure import cutlass_compile_cell
from kernels.core.toolchain import resolve
from tests.helpers import problem

TOOLS = resolve()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not TOOLS.usable or shutil.which("ninja") is None,
                                 reason=f"nvcc/CUTLASS/ninja missing: {TOOLS.message or 'ninja not on PATH'}")]


def test_cutlass_column_compiles_without_a_gpu():
    p = problem(m=64, n=64, k=64, dtype="fp16")
    cpu = p.__class__(**{**p.__dict__, "device": "cpu", "arch": 0, "device_name": "cpu"})
    cell = cutlass_compile_cell(Column("cutlass", "backend", "cutlass"), cpu)
    assert cell.status == "compiled", cell.message
    assert cell.best.startswith("cutlass3x_sm90_mm_fp16") and "built for sm90a" in cell.message
    again = cutlass_compile_cell(Column("cutlass", "backend", "cutlass"), cpu)     # now in the artifact store
    assert again.status == "compiled" and "already in the artifact store" in again.message
    assert get_backend("cutlass").available(cpu)[0] is False                          # it still never runs on CPU
