"""The one benchmark routine, used by tuning and by `bench`.

What is timed is the user's call (launch and output allocation included), back to back, rotating through several
input sets so small problems are not timed out of a warm L2: the per-call time of such a loop is what a user's
steady state sees, whether the call is bound by the host (launch cost) or by the device.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

Call = Callable[[int], object]      # call(i) runs the user call on input set i


@dataclass
class Timing:
    median_ms: float
    p20_ms: float
    p80_ms: float
    samples: int
    calls_per_sample: int

    def as_dict(self) -> dict:
        return asdict(self)


def user_call(launch, sets: list[tuple[torch.Tensor, torch.Tensor]]) -> Call:
    """call(i): the user's call on input set i, as the warm path makes it: through `launch.direct(a, b)` when the
    launch has one (aten's torch function, a Triton choice's native launch), else launch(a, b, None)."""
    direct = getattr(launch, "direct", None)
    if direct is not None:
        return lambda i: direct(*sets[i])
    return lambda i: launch(*sets[i], None)


def _quantile(sorted_values: list[float], q: float) -> float:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def summarize(per_call_ms: list[float], calls_per_sample: int) -> Timing:
    s = sorted(per_call_ms)
    return Timing(statistics.median(s), _quantile(s, 0.2), _quantile(s, 0.8), len(s), calls_per_sample)


class Sampler:
    """Times one callable: `plan()` picks calls per sample from a quick estimate, `sample()` returns ms per call."""

    def __init__(self, call: Call, n_sets: int, device: str):
        self.call, self.n_sets, self.device = call, max(1, n_sets), device
        self.counter = 0
        self.calls_per_sample = 1
        self.estimate_ms = 0.0

    def _run(self, count: int) -> None:
        for _ in range(count):
            self.call(self.counter % self.n_sets)
            self.counter += 1

    def quick(self) -> float:
        """A first estimate for the screen, ms per call: one call timed while the candidate's first, enqueued just
        before it, keeps the GPU busy -- so a GPU-bound call is timed without the host's launch gap, and the first
        call's setup (the launcher's first run, loading a kernel) is host work done before its kernel is queued.
        Where the GPU is idle already once the first call returns (its work was short, or loading a later launch
        of it synchronized: lazy loading may), one more call is queued first, so the timed one waits behind work.
        (A synchronized warm-up call before these cost each of a large problem's ~50 candidates one more call.)"""
        if self.device != "cuda":
            return self._timed(1)
        self._run(1)
        queued = torch.cuda.Event()
        queued.record()
        if queued.query():
            self._run(1)
        return self._timed(1)

    def plan(self, target_sample_ms: float = 1.0, warmup: int = 3) -> float:
        """Estimate ms per call with a probe, then size the samples from it (`plan_from`)."""
        if self.device == "cuda":
            self._run(warmup)
            torch.cuda.current_stream().synchronize()    # not the device's: see verify_launch
            probe = 5
            return self.plan_from(self._timed(probe) / probe, target_sample_ms)
        return self.plan_from(self._timed(1), target_sample_ms)

    def plan_from(self, estimate_ms: float, target_sample_ms: float = 1.0) -> float:
        """Size the samples from an estimate of ms per call (a GPU-bound call's `quick` is its kernel's time, so the
        first pass passes that and runs no probe): calls filling `target_sample_ms` on the GPU, one call off it."""
        self.estimate_ms = estimate_ms
        self.calls_per_sample = (int(min(1000, max(1, math.ceil(target_sample_ms / max(estimate_ms, 1e-4)))))
                                 if self.device == "cuda" else 1)
        return estimate_ms

    def _timed(self, count: int) -> float:
        """Milliseconds for `count` back-to-back calls."""
        if self.device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._run(count)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        self._run(count)
        return (time.perf_counter() - t0) * 1e3

    def sample(self) -> float:
        return self._timed(self.calls_per_sample) / self.calls_per_sample

    def samples_for(self, budget_ms: float, min_samples: int, max_samples: int | None) -> int:
        """How many samples `budget_ms` buys after `plan()`: at least `min_samples`, at most `max_samples` (default
        50 on CUDA, 3 elsewhere: interpreted calls are slow)."""
        if max_samples is None:
            max_samples = 50 if self.device == "cuda" else 3
        per_sample = max(self.estimate_ms * self.calls_per_sample, 1e-3)
        return int(min(max_samples, max(min_samples, budget_ms // per_sample)))


# First pass: a candidate this many times slower than the best so far after a few samples stops being measured (it
# cannot win; the budget goes to the contenders). It must stay above one candidate's first-pass jitter: int8
# 64x64x65536 split-K first-passed at 13.5-16.5 us (1.22x) over three H100 tunes
TUNE_CUTOFF = 1.25
# Before that, the screen: where the fastest candidate's quick estimate (`Sampler.quick`, one call) is
# QUICK_SCREEN_MIN_MS or more -- GPU-bound, so that one call is its kernel's time, not the host's -- a candidate whose
# estimate is more than QUICK_SCREEN times it stops after those calls (two, or three: `Sampler.quick`), before the
# GPU_BOUND_SAMPLES samples of >= 1 ms it would otherwise run; the hopeless are the slowest: Inductor's 28 bf16 tiles
# include 32x32x16 for 8192^3, and a new large problem spent 0.9-1.6 s in its first pass on the H100 (sixteenth
# session). Wide, because one call is taken before the clocks settle and the screen runs candidates one after another
# while the chip heats (aten 4096x11008x4096 went from 0.48 to 0.56 ms per call over a 3 s loop, fifteenth session);
# the final round's finalists are within a few percent of each other.
QUICK_SCREEN = 1.5
QUICK_SCREEN_MIN_MS = 0.1


# A GPU-bound candidate (the fastest quick estimate QUICK_SCREEN_MIN_MS or more) gets this many samples (each of >= 1
# ms of calls) instead of KERNELS_BENCH_MS's worth (24 for bf16 8192^3). Such a problem's winner is decided by the
# steady regime's duel (kernels.tune.final_round), which meets the first pass's fastest challenger only: the first
# pass need not rank finer than the bias the duel corrects -- its ratios to aten were 3-22% off those of 1.5 s loops
# on the H200 (experiments/duel_regime.py, twenty-second session) -- and a GPU-bound call's p20-p80 spans 0.3-8.7% of
# its median (docs/measurements/compare_cutlass_int8_nt.json), so the median of five is within ~1-2%. The test is the
# one-call estimate, the steady regime's the fastest median: a problem near 0.1 ms may take five samples and then meet
# the burst rules, which re-time the first pass's fastest three and aten side by side -- there too the first pass only
# has to bring the contenders in.
GPU_BOUND_SAMPLES = 5


def gpu_bound(best_quick_ms: float | None) -> bool:
    """Whether the fastest quick estimate says the problem's calls are bound by the GPU, not the host."""
    return best_quick_ms is not None and best_quick_ms >= QUICK_SCREEN_MIN_MS


def screened_out(quick_ms: dict[str, float], factor: float = QUICK_SCREEN) -> set[str]:
    """The candidates the screen stops: slower than `factor` times the fastest quick estimate, when that one says
    the calls are GPU-bound (`gpu_bound`); none otherwise (host-bound calls: one call measures the host)."""
    best = min(quick_ms.values(), default=None)
    if not gpu_bound(best):
        return set()
    return {n for n, ms in quick_ms.items() if ms > best * factor}


def measure(call: Call, n_sets: int, device: str, budget_ms: float, min_samples: int = 5,
            max_samples: int | None = None, stop_above_ms: float | None = None,
            screen_above_ms: float | None = None) -> Timing:
    """Median of up to `budget_ms` of samples. With `stop_above_ms`, a candidate whose median after `min_samples`
    is already above it stops there: it is out of the running, and the full budget is spent on contenders. With
    `screen_above_ms`, one whose quick estimate (`Sampler.quick`) is above it stops before that, timed by that one
    call (a sequential first pass's screen: the caller passes QUICK_SCREEN times its best so far, where that is
    QUICK_SCREEN_MIN_MS or more); one that stays and is GPU-bound itself is planned from that call, as
    `measure_interleaved` plans such candidates (the probe, a warm-up and five calls, would repeat it)."""
    sampler = Sampler(call, n_sets, device)
    if screen_above_ms is None:
        sampler.plan(warmup=3)
    else:
        quick = sampler.quick()
        if quick > screen_above_ms:
            return summarize([quick], 1)
        if gpu_bound(quick):
            sampler.plan_from(quick)
        else:
            sampler.plan(warmup=1)
    n = sampler.samples_for(budget_ms, min_samples, max_samples)
    samples = [sampler.sample() for _ in range(min(n, min_samples))]
    if stop_above_ms is None or statistics.median(samples) <= stop_above_ms:
        samples += [sampler.sample() for _ in range(n - len(samples))]
    return summarize(samples, sampler.calls_per_sample)


def measure_interleaved(calls: dict[str, Call], n_sets: int, device: str, budget_ms: float,
                        cutoff: float | None = None, min_samples: int = 5,
                        max_samples: int | None = None, screen: float | None = None,
                        trusted: Callable[[str], bool] | None = None,
                        ) -> tuple[dict[str, Timing], dict[str, str]]:
    """Tuning's first pass: each candidate gets the samples `measure` would give it, but round by round, one sample
    of every candidate still running per round (rotating who goes first), so drift -- clocks ramping up after a
    build, a busy host -- hits all of them alike instead of whichever was being timed then. Timed one after another,
    int8 1024x8192x512's two-launch tiles (28 us in a final round) first-passed above 40 us on the H100 and left
    the running. With `cutoff`, a candidate whose median after `min_samples` is above `cutoff` times the best
    median stops there. With `screen` (the first pass passes QUICK_SCREEN), every candidate first gets a quick
    estimate, and those `screened_out` stop there, timed by that one call; where the fastest estimate says the calls
    are GPU-bound, the rest get GPU_BOUND_SAMPLES samples. `trusted(name)`: whether a candidate may set the screen
    (the tuner verifies it then): fastest estimate first, those that fail it are dropped (neither timed nor failed:
    the caller recorded why), so a wrong but fast kernel cannot screen the others out. Returns (timings, failures:
    name -> what its call raised)."""
    samplers: dict[str, Sampler] = {}
    wanted: dict[str, int] = {}
    failed: dict[str, str] = {}
    quick: dict[str, float] = {}
    for name, call in calls.items():
        samplers[name] = Sampler(call, n_sets, device)
        if screen is not None:
            try:
                quick[name] = samplers[name].quick()
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result, not the end of the pass
                failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
    alive_quick = {n: q for n, q in quick.items() if n not in failed}
    if trusted is not None:
        for name in sorted(alive_quick, key=alive_quick.get):
            if trusted(name):
                break
            del alive_quick[name], quick[name], samplers[name]
    stopped = screened_out(alive_quick, screen) if screen else set()
    bound_by_gpu = bool(screen and alive_quick and gpu_bound(min(alive_quick.values())))
    if bound_by_gpu:
        max_samples = min(max_samples or GPU_BOUND_SAMPLES, GPU_BOUND_SAMPLES)
    samples: dict[str, list[float]] = {name: [quick[name]] if name in stopped else []
                                       for name in samplers if name not in failed}
    for name, sampler in samplers.items():
        if name in failed or name in stopped:
            continue
        try:
            if bound_by_gpu:    # the quick estimate is the kernel's time: the plan's probe would only repeat it
                sampler.plan_from(quick[name])
            else:
                sampler.plan(warmup=1 if name in quick else 3)
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
            del samples[name]
            continue
        wanted[name] = sampler.samples_for(budget_ms, min_samples, max_samples)
    running = list(wanted)
    turn = 0
    while running:
        shift = turn % len(running)
        for name in running[shift:] + running[:shift]:
            try:
                samples[name].append(samplers[name].sample())
            except Exception as e:  # noqa: BLE001
                failed[name] = f"{type(e).__name__}: {str(e)[:300]}"
        turn += 1
        running = [n for n in running if n not in failed and len(samples[n]) < wanted[n]]
        if cutoff is not None and running:
            medians = {n: statistics.median(v) for n, v in samples.items()
                       if n in wanted and n not in failed and len(v) >= min(min_samples, wanted[n])}
            if medians:
                best = min(medians.values())
                running = [n for n in running if medians.get(n, 0.0) <= best * cutoff]
    timed = {n: summarize(v, samplers[n].calls_per_sample) for n, v in samples.items() if n not in failed and v}
    # the screen's reference failed after screening the others: those within the screen of the fastest left are
    # measured after all (unscreened), rather than judged on one call against a candidate that is gone
    revived = stopped - set(failed) - screened_out({n: q for n, q in quick.items() if n not in failed}, screen) \
        if stopped else set()
    if revived:
        more, more_failed = measure_interleaved({n: calls[n] for n in calls if n in revived}, n_sets, device,
                                                budget_ms, cutoff, min_samples, max_samples)
        timed.update(more)
        failed.update(more_failed)
    return timed, failed


def measure_together(calls: dict[str, Call], n_sets: int, device: str, budget_ms: float,
                     rounds: int = 10) -> dict[str, Timing]:
    """Re-time several candidates interleaved, round by round, so drift (clocks, heat) hits them all alike."""
    samplers = {name: Sampler(call, n_sets, device) for name, call in calls.items()}
    for s in samplers.values():
        s.plan()
    cost = sum(max(s.estimate_ms * s.calls_per_sample, 1e-3) for s in samplers.values())
    rounds = int(max(3, min(rounds * 5, budget_ms // cost))) if device == "cuda" else 2
    per_call: dict[str, list[float]] = {name: [] for name in calls}
    order = list(samplers)
    for r in range(rounds):
        # rotate who goes first each round: the first sample after a pause must not always be the same candidate
        for name in order[r % len(order):] + order[:r % len(order)]:
            per_call[name].append(samplers[name].sample())
    return {name: summarize(v, samplers[name].calls_per_sample) for name, v in per_call.items()}


def rotation_sets(bytes_per_set: int, device: str, l2_bytes: int | None = None, max_sets: int = 64,
                  max_total_bytes: int = 1 << 30) -> int:
    """How many input sets to rotate through so consecutive calls do not find their inputs in L2."""
    if device != "cuda":
        return 1
    if l2_bytes is None:
        l2_bytes = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 50 << 20)
    want = math.ceil(3 * l2_bytes / max(bytes_per_set, 1))
    fit = max(1, max_total_bytes // max(bytes_per_set, 1))
    return int(max(1, min(want, max_sets, fit)))


_side_streams: dict[int, "torch.cuda.Stream"] = {}


def _side_stream() -> "torch.cuda.Stream":
    """One warm-up stream per device, reused: launchers keep workspaces per stream, so a fresh stream per
    measurement would leave a fresh workspace behind each time."""
    index = torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream()
    return stream


# what a one-launch call costs beyond its kernel when the GPU is the bottleneck: the 10th percentile of call - GPU
# time over the one-launch candidates relabelled on the H100 (0.93-1.39 us per template, 2026-11-23)
LAUNCH_GAP_MS = 0.0012
# below this per call, a candidate's call time is the host's more than its kernel's: the host floor is 10-15 us per
# call on the lent H100s, and a problem this close to it has candidates at the floor
HOST_SET_MAX_MS = 0.025


def device_time_ms(call: Call, n_sets: int, reps: int = 20, replays: int = 10) -> float | None:
    """GPU time per call with the host taken out: `reps` calls (rotating input sets) captured in a CUDA graph and
    replayed. None when the call cannot be captured (that is data, not an error: the caller falls back to the
    host-inclusive time)."""
    try:
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):       # warm up off the default stream, as capture requires
            for i in range(3):
                call(i % max(1, n_sets))
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # captured on this device's side stream, not through torch.cuda.graph: its default capture stream is made
        # once per process on the device current then (a later capture for another GPU would go there: the likely
        # source of 1 KB allocated on cuda:0 while tuning for cuda:1, seen on 2xH200), and it synchronizes the whole
        # device first, which under DDP would wait on an all-reduce whose peer waits for this tune
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")   # other threads (NCCL's watchdog) go on
            try:
                for i in range(reps):
                    call(i % max(1, n_sets))
            finally:
                graph.capture_end()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / (replays * reps)
    except Exception:  # noqa: BLE001 - e.g. a launcher that synchronizes; capture is a refinement, not a requirement
        if torch.cuda.is_available():
            try:
                torch.cuda.current_stream().synchronize()     # drain what ran before; a sticky error shows up
            except Exception:  # noqa: BLE001
                pass
        return None
