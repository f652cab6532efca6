"""A selection's table with its rounds, as `kernels.explain(...).table(rounds=True)` and bench print it: pure, from
timings given."""
import torch


def test_selection_table_with_rounds_lists_every_timed_choice_fastest_first_with_its_round_times():
    from kernels.core.choice import Choice
    from kernels.core.problem import GemmProblem
    from kernels.core.selection import Selection

    problem = GemmProblem.from_tensors("mm", torch.empty(64, 64), torch.empty(64, 64))
    sel = Selection(problem, "fast", {n: Choice("aten", n, "fp32") for n in ("fast", "slow", "broken")},
                    timings={"slow": 0.0165, "fast": 0.0119, "broken": "failed verification: max error 3.0"},
                    details={"fast": {"first_pass_ms": 0.0145, "final_ms": 0.0119, "gpu_ms": 0.0106}, "slow": {}},
                    notes=["triton: benchmarking 5 of 1179 candidates"])
    lines = sel.table(rounds=True).splitlines()[1:]
    assert lines[0].split()[:3] == ["*", "fast", "11.90"]
    assert "first_pass_ms 14.50" in lines[0] and "gpu_ms 10.60" in lines[0]
    assert lines[1].split()[:2] == ["slow", "16.50"] and "first_pass_ms" not in lines[1]
    assert lines[2].split()[:2] == ["broken", "failed"] and lines[2].endswith("max error 3.0")
    assert lines[3] == "   note: triton: benchmarking 5 of 1179 candidates"
    assert "first_pass_ms" not in sel.table()                  # the default table is as it was
