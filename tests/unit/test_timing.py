"""kernels.measure.timing: the early stop that keeps tuning short (CPU timing path; the CUDA path shares the logic)."""
import time

import pytest
import torch

from kernels.measure.timing import measure


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
    from kernels.measure.timing import device_time_ms

    calls = []
    assert device_time_ms(lambda i: calls.append(i), 2) is None      # no CUDA: no graph, no exception


class _FakeClock:
    """A host clock only the timed calls move: each call advances it by its cost (deterministic timing on CPU)."""

    def __init__(self):
        self.now = 0.0
        self.calls = 0

    def perf_counter(self):
        return self.now

    def call(self, ms, slow_first_calls=0, slow_ms=0.0):
        def run(i):
            self.calls += 1
            self.now += (slow_ms if self.calls <= slow_first_calls else ms) / 1e3
        return run


@pytest.fixture
def clock(monkeypatch):
    from kernels.measure import timing

    fake = _FakeClock()
    monkeypatch.setattr(timing, "time", fake)
    return fake


def test_interleaved_first_pass_spreads_drift_over_every_candidate(clock):
    """Two equal candidates and a host slow for the first 10 calls made, whoever makes them: timed one after the
    other, the first absorbs all of it; interleaved, neither is ranked apart."""
    from kernels.measure.timing import measure_interleaved

    a, b = clock.call(1.0, 10, 3.0), clock.call(1.0, 10, 3.0)
    seq_a = measure(a, 1, "cpu", budget_ms=100, max_samples=9)
    seq_b = measure(b, 1, "cpu", budget_ms=100, max_samples=9)
    assert (seq_a.median_ms, seq_b.median_ms) == pytest.approx((3.0, 1.0))   # what sequential timing made of it

    clock.calls = 0
    timed, failed = measure_interleaved({"a": a, "b": b}, 1, "cpu", budget_ms=100, max_samples=9)
    assert not failed and (timed["a"].median_ms, timed["b"].median_ms) == pytest.approx((1.0, 1.0))
    assert timed["a"].samples == timed["b"].samples == 9


def test_interleaved_first_pass_stops_candidates_beyond_the_cutoff(clock):
    from kernels.measure.timing import measure_interleaved

    calls = {"fast": clock.call(1.0), "close": clock.call(1.2), "slow": clock.call(2.0)}
    timed, _ = measure_interleaved(calls, 1, "cpu", budget_ms=100, cutoff=1.25, min_samples=3, max_samples=9)
    assert timed["slow"].samples == 3 and timed["slow"].median_ms == pytest.approx(2.0)
    assert timed["fast"].samples == timed["close"].samples == 9


def test_interleaved_first_pass_reports_a_crashing_candidate_and_times_the_rest(clock):
    from kernels.measure.timing import measure_interleaved

    count = {"n": 0}

    def flaky(i):
        count["n"] += 1
        if count["n"] > 4:
            raise RuntimeError("illegal memory access")
        clock.now += 1e-3

    def broken(i):
        raise ValueError("bad launch")
    timed, failed = measure_interleaved({"ok": clock.call(1.0), "flaky": flaky, "broken": broken}, 1, "cpu",
                                        budget_ms=100, max_samples=9)
    assert set(timed) == {"ok"} and timed["ok"].samples == 9
    assert "illegal memory access" in failed["flaky"] and failed["broken"].startswith("ValueError: bad launch")


def test_the_quick_screen_stops_the_hopeless_after_one_call(clock):
    """bf16 8192^3's Inductor list holds tiles 2-10x slower than the best: past QUICK_SCREEN times the fastest quick
    estimate they stop after it (timed by that one call), before the plan and minimum samples cost them ~13 calls.
    The calls being GPU-bound, the rest get GPU_BOUND_SAMPLES samples, not the budget's nine."""
    from kernels.measure.timing import GPU_BOUND_SAMPLES, QUICK_SCREEN, measure_interleaved

    calls = {"fast": clock.call(1.0), "close": clock.call(1.4), "slow": clock.call(2.0), "hopeless": clock.call(9.0)}
    timed, failed = measure_interleaved(calls, 1, "cpu", budget_ms=100, cutoff=1.25, min_samples=3, max_samples=9,
                                        screen=QUICK_SCREEN)
    assert not failed
    assert timed["slow"].samples == timed["hopeless"].samples == 1
    assert timed["hopeless"].median_ms == pytest.approx(9.0)
    assert timed["fast"].samples == GPU_BOUND_SAMPLES == 5
    assert timed["close"].samples == 3     # 1.4x: past the cutoff, not the screen


def test_gpu_bound_candidates_are_planned_from_their_quick_estimate(clock):
    """Where the quick estimates say the calls are GPU-bound, that one call (the kernel's time) sizes the samples:
    no plan probe is run (on the GPU: a warm-up and five calls a candidate), each candidate makes its quick call
    and its GPU_BOUND_SAMPLES samples only. Host-bound calls keep the probe."""
    from kernels.measure.timing import GPU_BOUND_SAMPLES, QUICK_SCREEN, measure_interleaved

    made = {}

    def counted(name, ms):
        run = clock.call(ms)

        def call(i):
            made[name] = made.get(name, 0) + 1
            run(i)
        return call
    calls = {"a": counted("a", 0.5), "b": counted("b", 0.55)}
    timed, _ = measure_interleaved(calls, 1, "cpu", budget_ms=100, min_samples=3, max_samples=9, screen=QUICK_SCREEN)
    assert timed["a"].calls_per_sample == timed["b"].calls_per_sample == 1     # off the GPU: one call a sample
    assert made == {"a": 1 + GPU_BOUND_SAMPLES, "b": 1 + GPU_BOUND_SAMPLES}
    made.clear()
    calls = {"a": counted("a", 0.02), "b": counted("b", 0.03)}
    measure_interleaved(calls, 1, "cpu", budget_ms=100, min_samples=3, max_samples=9, screen=QUICK_SCREEN)
    assert made == {"a": 1 + 1 + 9, "b": 1 + 1 + 9}      # quick, the probe (one call off the GPU), the samples


def test_plan_from_sizes_gpu_samples_to_a_millisecond():
    from kernels.measure.timing import Sampler

    on_gpu = Sampler(lambda i: None, 1, "cuda")
    assert on_gpu.plan_from(0.3) == 0.3 and on_gpu.calls_per_sample == 4 and on_gpu.estimate_ms == 0.3
    on_gpu.plan_from(2.0)
    assert on_gpu.calls_per_sample == 1
    off_gpu = Sampler(lambda i: None, 1, "cpu")
    off_gpu.plan_from(0.3)
    assert off_gpu.calls_per_sample == 1


def test_the_quick_screen_leaves_host_bound_calls_alone(clock):
    """Under QUICK_SCREEN_MIN_MS one call measures the host's launch as much as the kernel: no one is screened."""
    from kernels.measure.timing import QUICK_SCREEN, measure_interleaved, screened_out

    calls = {"fast": clock.call(0.02), "slow": clock.call(0.09)}
    timed, _ = measure_interleaved(calls, 1, "cpu", budget_ms=100, min_samples=3, max_samples=9, screen=QUICK_SCREEN)
    assert timed["slow"].samples == timed["fast"].samples == 9
    assert screened_out({"a": 0.05, "b": 1.0}) == set() and screened_out({"a": 0.2, "b": 0.31}) == {"b"}
    assert screened_out({}) == set()


def test_a_sequential_first_pass_screens_against_the_best_so_far(clock):
    """The isolated child times candidates one by one: `screen_above_ms` stops one after its quick estimate."""
    slow = measure(clock.call(4.0), 1, "cpu", budget_ms=100, max_samples=9, screen_above_ms=1.5)
    assert slow.samples == 1 and slow.median_ms == pytest.approx(4.0)
    ok = measure(clock.call(1.2), 1, "cpu", budget_ms=100, max_samples=9, screen_above_ms=1.5, stop_above_ms=1.25)
    assert ok.samples == 9


def test_a_sequential_gpu_bound_candidate_is_planned_from_its_quick_estimate(clock):
    """In the isolated child a candidate that passes the screen and is GPU-bound itself runs no plan probe (a
    warm-up and five calls, 6 of the 14 a large candidate made in the child): its quick call sizes the samples, as in
    `measure_interleaved`. A host-bound one keeps the probe; without a screen every candidate plans as before."""
    made = {"n": 0}

    def counted(ms):
        run = clock.call(ms)

        def call(i):
            made["n"] += 1
            run(i)
        return call
    gpu_bound = measure(counted(1.2), 1, "cpu", budget_ms=100, max_samples=5, screen_above_ms=1.5)
    assert gpu_bound.samples == 5 and gpu_bound.median_ms == pytest.approx(1.2)
    assert made["n"] == 1 + 5                   # the quick estimate (one call off the GPU), the samples
    made["n"] = 0
    measure(counted(0.05), 1, "cpu", budget_ms=100, max_samples=5, screen_above_ms=1.5)
    assert made["n"] == 1 + 1 + 5               # quick, the probe (one call off the GPU), the samples
    made["n"] = 0
    measure(counted(1.2), 1, "cpu", budget_ms=100, max_samples=5)
    assert made["n"] == 1 + 5                   # the probe, the samples


def test_a_candidate_that_crashes_on_its_quick_estimate_is_reported(clock):
    from kernels.measure.timing import QUICK_SCREEN, measure_interleaved

    def broken(i):
        raise RuntimeError("misaligned address")
    timed, failed = measure_interleaved({"ok": clock.call(1.0), "broken": broken}, 1, "cpu", budget_ms=100,
                                        max_samples=9, screen=QUICK_SCREEN)
    assert set(timed) == {"ok"} and "misaligned address" in failed["broken"]


def test_the_isolated_child_applies_the_first_pass_cutoffs_against_its_best_so_far():
    from backends.isolated_child import _cutoffs
    from kernels.measure.timing import GPU_BOUND_SAMPLES, QUICK_SCREEN, TUNE_CUTOFF

    assert _cutoffs(None, "cuda") == {}
    assert _cutoffs(2.0, "cuda") == {"stop_above_ms": 2.0 * TUNE_CUTOFF, "screen_above_ms": 2.0 * QUICK_SCREEN,
                                     "max_samples": GPU_BOUND_SAMPLES}
    assert _cutoffs(0.05, "cuda") == {"stop_above_ms": 0.05 * TUNE_CUTOFF, "screen_above_ms": None}   # host-bound
    assert _cutoffs(2.0, "cpu")["screen_above_ms"] is None      # interpreted: one call is not the kernel's time


def test_the_isolated_child_starts_from_the_callers_first_pass(monkeypatch):
    """The child's cutoffs start from the caller's fastest first-pass median (one first pass over both processes), so
    its first candidate is capped at GPU_BOUND_SAMPLES too; a malformed value is ignored."""
    from backends import child_handle, isolated_child
    from kernels.core.choice import Choice
    from kernels.measure.timing import GPU_BOUND_SAMPLES
    from kernels.space.heuristics import GemmConfig
    from tests.helpers import problem

    sent = []

    class FakeChild:
        def ask(self, request, timeout_s):
            sent.append(request)
            return "", "done"
    monkeypatch.setattr(child_handle, "warmed", lambda timeout_s: "ready")
    monkeypatch.setattr(child_handle, "started", lambda: FakeChild())
    cs = [Choice("triton", "triton_mm", "bf16", GemmConfig(64, 64, 32, 3, 4))]
    isolated_child.run_isolated("triton", problem(), cs, 40.0, 10.0, best_ms=0.7)
    isolated_child.run_isolated("triton", problem(), cs, 40.0, 10.0)
    assert [r["best_ms"] for r in sent] == [0.7, None]
    assert isolated_child._positive_or_none(0.7) == 0.7
    assert all(isolated_child._positive_or_none(v) is None for v in (None, "1", True, -1.0, 0.0, float("nan")))
    assert isolated_child._cutoffs(0.7, "cuda")["max_samples"] == GPU_BOUND_SAMPLES
    # a sequential measurement honours the cap however large the budget
    assert measure(lambda i: time.sleep(0.002), 1, "cpu", budget_ms=1e4, max_samples=GPU_BOUND_SAMPLES).samples == 5


def test_the_tuner_hands_the_child_its_fastest_first_pass(monkeypatch):
    from types import SimpleNamespace

    from kernels.tune import autotune

    seen = {}

    class Isolated:
        def measure_isolated(self, problem, group, budget_ms, best_ms=None, verify_all=False):
            seen["best_ms"] = best_ms
            return {r.choice.name: "failed: x" for r in group}
    monkeypatch.setattr(autotune, "get_backend", lambda name: Isolated())
    runner = SimpleNamespace(choice=SimpleNamespace(backend="cutlass", name="k"))
    timings = {"aten_mm": 0.52, "triton_mm_a": 0.48, "triton_mm_b": "crashed while timing: x"}
    assert autotune.measure_isolated(None, {"k": runner}, timings, {}) == {}
    assert seen["best_ms"] == 0.48 and timings["k"] == "failed: x"
    autotune.measure_isolated(None, {"k": runner}, {}, {})
    assert seen["best_ms"] is None


def test_candidates_screened_against_one_that_then_fails_are_measured_after_all(clock):
    """The screen's reference crashes after its quick estimate: those it stopped are not left judged on one call."""
    from kernels.measure.timing import QUICK_SCREEN, measure_interleaved

    count = {"n": 0}

    def fast_then_broken(i):
        count["n"] += 1
        if count["n"] > 3:                     # its quick estimate and a few calls, then nothing
            raise RuntimeError("illegal memory access")
        clock.now += 1e-3
    calls = {"ref": fast_then_broken, "b": clock.call(2.0), "c": clock.call(2.1), "d": clock.call(9.0)}
    timed, failed = measure_interleaved(calls, 1, "cpu", budget_ms=100, cutoff=1.25, min_samples=3, max_samples=9,
                                        screen=QUICK_SCREEN)
    assert set(failed) == {"ref"}
    # within the screen of the fastest left: measured, as GPU-bound calls are (GPU_BOUND_SAMPLES)
    assert timed["b"].samples == timed["c"].samples == 5
    assert timed["d"].samples == 1                            # still 4.5x the fastest left: stays screened


def test_quick_times_a_call_queued_behind_the_first_and_one_more_where_the_gpu_went_idle(monkeypatch):
    """On the GPU the quick estimate times a call queued behind the candidate's first (2 calls); where the GPU idles
    already when the first call returns (short work, or a launch that synchronized to load a kernel), one more is
    queued first (3), so the timed call never includes the host's launch gap. The CUDA event is faked here."""
    from kernels.measure import timing

    idle = {"now": False}

    class FakeEvent:
        def __init__(self, **kwargs):
            pass

        def record(self):
            pass

        def query(self):
            return idle["now"]

    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    made = []
    sampler = timing.Sampler(made.append, 3, "cuda")
    monkeypatch.setattr(sampler, "_timed", lambda count: (sampler._run(count), 0.5)[1])
    assert sampler.quick() == 0.5 and made == [0, 1]
    idle["now"] = True
    assert sampler.quick() == 0.5 and made == [0, 1, 2, 0, 1]
