"""bench.exhaustive_reference on CPU: its problem list parses and it refuses to run without a GPU (the full
exhaustive tune it makes is GPU work; bench/gpu_check.sh exhaustive runs it)."""
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
