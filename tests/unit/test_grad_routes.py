"""Which autograd serves a grad call: kernels' Function only where the layer's winners save more GPU time over aten
than the Function costs in host time (kernels.dispatch.ops.kernels_gain_us, FUNCTION_HOST_US)."""
import math

import pytest
import torch

import kernels
from kernels.core.choice import Choice
from kernels.core.selection import Selection
from kernels.dispatch import api, ops, selected
from tests.helpers import problem

ATEN, TRITON = Choice("aten", "aten_mm", "bf16"), Choice("triton", "triton_mm", "bf16", params=(("x", 1),))


def sel(winner: str, timings: dict) -> Selection:
    return Selection(problem=problem(), winner=winner, choices={"aten_mm": ATEN, TRITON.name: TRITON},
                     timings=timings)


def test_gain_sums_what_each_winner_saves_over_aten_in_microseconds():
    forward = sel(TRITON.name, {"aten_mm": 0.030, TRITON.name: 0.020})      # 10 us saved
    dx = sel("aten_mm", {"aten_mm": 0.010, TRITON.name: 0.012})            # aten won: nothing
    dw = sel(TRITON.name, {"aten_mm": 0.0255, TRITON.name: 0.0250})        # 0.5 us
    assert ops.kernels_gain_us([forward, dx, dw, None]) == pytest.approx(10.5)


def test_gain_is_unbounded_where_aten_has_no_time_to_compare_with():
    assert math.isinf(ops.kernels_gain_us([sel(TRITON.name, {TRITON.name: 0.02, "aten_mm": "crashed: boom"})]))
    assert math.isinf(ops.kernels_gain_us([sel(TRITON.name, {"aten_mm": 0.03})]))
    assert ops.kernels_gain_us([]) == 0.0


@pytest.mark.parametrize("gain_us, route", [(5.0, "torch"), (500.0, "kernels")])
def test_a_small_gain_hands_the_layer_to_torch_and_a_large_one_keeps_kernels(monkeypatch, gain_us, route):
    """The route follows the gain (the tunes are faked: resolve records nothing, the selections say the gain)."""
    monkeypatch.setattr(api, "_cpu_fallback", lambda like: False)
    monkeypatch.setattr(api._record, "resolve", lambda problem, *args: None)
    monkeypatch.setattr(api, "_prepare", lambda problem, like: None)
    monkeypatch.setattr(selected, "selection", lambda problem: sel(
        TRITON.name, {"aten_mm": 0.05 + gain_us / 3e3, TRITON.name: 0.05}))
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    before = kernels.stats()["torch_autograd"]
    call = api._grad_route_linear(x, w, None, None)
    if route == "torch":
        assert call is torch.nn.functional.linear and kernels.stats()["torch_autograd"] == before + 1
    else:
        assert call is not torch.nn.functional.linear and kernels.stats()["torch_autograd"] == before
    api.clear_memory_cache()


def test_the_backward_look_ahead_knows_a_layer_by_its_operands_facts_not_their_identity():
    """Under autocast every forward's weight is a fresh cast: a new tensor with the same dtype, shape and strides
    meets the look-ahead once, not once per step."""
    from kernels.dispatch.ops import BackwardAhead

    prepared = []
    ahead = BackwardAhead(lambda problem, like: prepared.append(problem), lambda: 100)
    x = torch.randn(4, 16)
    for _ in range(3):
        ahead.linear(x, torch.randn(8, 16), (True, True))
    assert len(prepared) == 2                  # dX and dW, once
    ahead.linear(x, torch.randn(8, 16).t().contiguous().t(), (True, True))     # another layout: met again
    assert len(prepared) == 4
    ahead.forget()
    ahead.linear(x, torch.randn(8, 16), (True, True))
    assert len(prepared) == 6
