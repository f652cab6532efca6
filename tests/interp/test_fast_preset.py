"""experiments.fast_preset's same-run ratio through the interpreter (its pure parts:
tests/unit/test_experiments.py)."""


def test_fast_preset_times_its_winner_beside_the_dataset_best():
    """fast_preset's same-run ratio: the tuned winner and the dataset's best, built now, timed together."""
    import torch

    from backends import get_backend
    from experiments.fast_preset import _side_by_side
    from kernels.core.choice import Choice
    from kernels.space.heuristics import GemmConfig
    from kernels.core.problem import GemmProblem

    a, b = torch.randn(24, 40).half(), torch.randn(40, 16).half()
    p = GemmProblem.from_tensors("mm", a, b)
    (winner,) = get_backend("triton").build(p, [Choice("triton", "triton_mm", "fp16", GemmConfig(16, 16, 16, 1, 2))])
    side = _side_by_side(p, winner.runner, Choice("aten", "aten_mm", "fp16"))
    assert side["fast_ms"] > 0 and side["best_ms"] > 0 and side["ratio"] == side["fast_ms"] / side["best_ms"]
    assert _side_by_side(p, winner.runner, winner.choice)["ratio"] == 1.0
    unbuildable = Choice("triton", "triton_mm", "fp16", None)          # no config: the template cannot render
    assert "did not build" in _side_by_side(p, winner.runner, unbuildable)["error"]
