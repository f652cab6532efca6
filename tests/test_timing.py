"""kernels.timing: the early stop that keeps tuning short (CPU timing path; the CUDA path shares the logic)."""
import time

import pytest
import torch

from kernels.timing import measure


def _sleeper(ms):
    def call(i):
        time.sleep(ms / 1e3)
    return call


def test_candidate_above_the_cutoff_stops_after_min_samples():
    slow = measure(_sleeper(2.0), 1, "cpu", budget_ms=100, min_samples=2, stop_above_ms=0.5)
    assert slow.samples == 2 and slow.median_ms >= 2.0


def test_contender_gets_the_full_budget():
    fast = measure(_sleeper(2.0), 1, "cpu", budget_ms=100, min_samples=2, stop_above_ms=100.0)
    full = measure(_sleeper(2.0), 1, "cpu", budget_ms=100, min_samples=2)
    assert fast.samples == full.samples == 3          # the CPU path caps at 3 samples


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU contract")
def test_device_time_is_none_when_nothing_can_be_captured():
    from kernels.timing import device_time_ms

    calls = []
    assert device_time_ms(lambda i: calls.append(i), 2) is None      # no CUDA: no graph, no exception
