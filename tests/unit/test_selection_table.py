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
    assert lines[1].startswith("   (first pass only")
    assert lines[2].split()[:3] == ["slow", "16.50", "us"] and lines[2].split()[3] == "100.0%"
    assert "first_pass_ms" not in lines[2]
    assert lines[3].split()[:2] == ["broken", "failed"] and lines[3].endswith("max error 3.0")
    assert lines[4] == "   note: triton: benchmarking 5 of 1179 candidates"
    assert "first_pass_ms" not in sel.table()                  # the default table has no round columns


def test_a_steady_winner_ranks_over_first_pass_times_it_never_met():
    """In the steady regime a tile's 40 ms first pass runs ahead of what it does in 1 s windows: 4096^3 on the H100,
    a TMA tile at 181 us in the first pass that aten (202.5 us) beat in the duel. Sorted together, aten showed at
    89% of the best and bench printed a regret of 11.8%; each round is ranked on its own."""
    from kernels.core.choice import Choice
    from kernels.core.problem import GemmProblem
    from kernels.core.selection import Selection

    problem = GemmProblem.from_tensors("mm", torch.empty(64, 64), torch.empty(64, 64))
    names = ("aten_mm", "tma_duelled", "tma_first_pass_only")
    sel = Selection(problem, "aten_mm", {n: Choice("aten", n, "fp32") for n in names},
                    timings={"aten_mm": 0.2025, "tma_duelled": 0.2104, "tma_first_pass_only": 0.1810},
                    details={"aten_mm": {"first_pass_ms": 0.2050, "final_ms": 0.2025},
                             "tma_duelled": {"first_pass_ms": 0.1830, "final_ms": 0.2104},
                             "tma_first_pass_only": {"median_ms": 0.1810}}, regime="steady")
    assert sorted(sel.finalists()) == ["aten_mm", "tma_duelled"]
    assert [n for n, _ in sel.ranked()] == ["aten_mm", "tma_duelled", "tma_first_pass_only"]
    assert sel.regret() == 0.0
    lines = sel.table().splitlines()[1:]
    assert lines[0].split()[:4] == ["*", "aten_mm", "202.50", "us"] and lines[0].endswith("100.0%")
    assert lines[1].split()[0] == "tma_duelled" and lines[2].startswith("   (first pass only")
    assert lines[3].split()[0] == "tma_first_pass_only" and lines[3].endswith("100.0%")
    kept = Selection(problem, "tma_duelled", sel.choices, sel.timings, sel.details)
    assert abs(kept.regret() - (0.2104 / 0.2025 - 1)) < 1e-12
    no_round = Selection(problem, "aten_mm", sel.choices, sel.timings, {})
    assert no_round.regret() is None and "first pass only" not in no_round.table()
