"""The narrowing stage end to end: one interpreter tune with an 'only' lookup table (tests/unit/test_candidates.py
has the stage's rules)."""
import torch

import kernels
from backends import get_backend
from kernels.core.problem import GemmProblem
from kernels.tune.autotune import tune
from tests.helpers import write_lut


def test_tune_through_the_interpreter_with_lut_only_and_top_k(tmp_path):
    """int8 is exact in the interpreter: a 16x16x32 tune with an 'only' table builds only the table's choices."""
    a = torch.randint(-8, 8, (16, 32), dtype=torch.int8)
    b = torch.randint(-8, 8, (32, 16), dtype=torch.int8)
    p = GemmProblem.from_tensors("int_mm", a, b)
    cands = get_backend("triton").choices(p, "default")[0]
    picked = [c.name for c in cands if c.template == "triton_int8_mm"][:2]
    write_lut(tmp_path, [{"gpu": "*", "op": "int_mm", "dtype": "int8", "shape": [16, 16, 32], "mode": "only",
                          "choices": picked}])
    sel, _ = tune(p, ("aten", "triton"))
    timed = [n for n, t in sel.timings.items() if isinstance(t, float)]
    assert sorted(timed) == sorted(picked)
    assert sel.winner in picked
    assert any("'only'" in n for n in sel.notes)
    assert torch.equal(kernels.int_mm(a, b), a.int() @ b.int())      # kernels.int_mm serves a table choice
