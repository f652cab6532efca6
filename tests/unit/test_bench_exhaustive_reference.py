"""bench.exhaustive_reference on CPU: its problem list parses, it refuses to run without a GPU (the full exhaustive
tune it makes is GPU work; bench/gpu_check.sh exhaustive runs it), and the side-by-side it shares with
bench.fast_preset times both launches."""
import argparse

import pytest
import torch

from bench import exhaustive_reference as er


def test_problem_list_parses_and_rejects_bad_items():
    assert er.parse_problems("int8:4000x4000x320, bf16:96X22016x4096") == [
        ("int_mm", "int8", 4000, 4000, 320), ("mm", "bf16", 96, 22016, 4096)]
    for bad in ("int8:4000x4000", "fp64:8x8x8", "bf16:0x8x8", "8x8x8"):
        with pytest.raises(argparse.ArgumentTypeError):
            er.parse_problems(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit) as e:
        er.main(["--problems", "int8:64x64x64"])
    assert e.value.code == 2


def test_timed_together_times_both_launches_over_the_rotated_sets():
    """The side-by-side both bench.fast_preset and bench.exhaustive_reference judge by, on CPU."""
    from bench.fast_preset import timed_together
    from kernels.core.problem import GemmProblem
    from kernels.measure.verify import make_inputs

    a = torch.randn(16, 32)
    b = torch.randn(32, 8)
    problem = GemmProblem.from_tensors("mm", a, b)
    seen = {"a": 0, "b": 0}

    def launch(name):
        def run(x, y, out):
            seen[name] += 1
            return x @ y
        return run

    fast_ms, other_ms = timed_together(problem, make_inputs(problem, "cpu", seed=1), launch("a"), launch("b"), 1.0)
    assert fast_ms > 0 and other_ms > 0
    assert seen["a"] > 0 and seen["a"] == seen["b"]
