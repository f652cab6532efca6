"""Verification on demand (kernels.tune.final_round.OnDemandCheck): the first pass times every candidate unverified,
and only a candidate a Selection's readers may run is verified -- the first pass's fastest VERIFIED_TOP (the fastest
before the regime is chosen), the steady regime's baseline and challenger, every candidate of the burst regime, all
with verify_all. A candidate that fails never runs in the final round; one never verified cannot win.
Also the child's side of it (backends.isolated_child) and the compact reference the checks compare with."""
import json

import pytest
import torch

from backends import isolated_child
from kernels.core.choice import Choice
from kernels.core.problem import GemmProblem
from kernels.measure.steady import SteadyPlan
from kernels.measure.timing import Timing
from kernels.measure.verify import Reference, check, make_inputs, prepare_reference, reference
from kernels.space.heuristics import GemmConfig
from kernels.tune import final_round as fr
from tests.unit.test_steady_round import FakeChip

ATEN = Choice("aten", "aten_mm", "bf16")
TILES = [Choice("triton", "triton_tma_mm", "bf16", GemmConfig(128, bn, 64, 3, 8)) for bn in (64, 128, 256)]
SLOW = Choice("triton", "triton_mm", "bf16", GemmConfig(32, 32, 32, 2, 4))
PLAN = SteadyPlan(heat_ms=0, window_ms=300, rounds=1, settle_fraction=0.5)


def _select(monkeypatch, first_pass: dict[str, float], wrong=(), device="cuda", chip=None, final=None,
            verify_all=False):
    """select() over fake calls: `first_pass` ms per name, `wrong` names fail verification; the steady round on
    `chip`, the burst round's re-timing from `final` (default: the first pass). Returns (outcome, names verified in
    order, timings)."""
    choices = {c.name: c for c in [ATEN, *TILES, SLOW]}
    monkeypatch.setattr(fr, "measure_interleaved", lambda calls, *a, **k: (
        {n: Timing(first_pass[n], first_pass[n], first_pass[n], 5, 1) for n in calls}, {}))
    monkeypatch.setattr(fr, "measure_together", lambda calls, *a, **k: {
        n: Timing((final or first_pass)[n], (final or first_pass)[n], (final or first_pass)[n], 10, 1)
        for n in calls})
    monkeypatch.setattr(fr, "plan_for", lambda device: PLAN)
    asked: list[str] = []

    def verify(name):
        asked.append(name)
        return "wrong result: relative error 1 > 0.01" if name in wrong else None
    timings: dict = {}
    outcome = fr.select({n: n for n in first_pass}, choices, 1, device, 40.0, timings=timings,
                        windows=(lambda fns: chip) if chip is not None else None, verify=verify,
                        verify_all=verify_all)
    return outcome, asked, timings


def test_a_steady_problem_verifies_the_fastest_three_and_the_baseline_only(monkeypatch):
    first = {ATEN.name: 0.60, TILES[0].name: 0.57, TILES[1].name: 0.58, TILES[2].name: 0.59, SLOW.name: 0.9}
    chip = FakeChip(burst=first, sustained=first)
    outcome, asked, timings = _select(monkeypatch, first, chip=chip)
    assert fr.VERIFIED_TOP == 3 and asked == [TILES[0].name, TILES[1].name, TILES[2].name, ATEN.name]
    assert chip.windows[:2] == [ATEN.name, TILES[0].name]
    assert timings[SLOW.name] == fr.not_verified(first[SLOW.name])
    assert outcome.details[SLOW.name]["median_ms"] == first[SLOW.name]
    assert outcome.winner == TILES[0].name              # 5% ahead sustained too: verified, so it may win
    assert any("1 candidate(s) timed but not verified" in n for n in outcome.notes)


def test_verify_all_verifies_every_timed_candidate(monkeypatch):
    first = {ATEN.name: 0.60, TILES[0].name: 0.57, TILES[1].name: 0.58, TILES[2].name: 0.59, SLOW.name: 0.9}
    outcome, asked, timings = _select(monkeypatch, first, chip=FakeChip(first, first), verify_all=True)
    assert sorted(asked) == sorted(first) and all(isinstance(timings[n], float) for n in first)


def test_the_fastest_candidate_that_fails_verification_never_runs_in_the_duel(monkeypatch):
    first = {ATEN.name: 0.60, TILES[0].name: 0.30, TILES[1].name: 0.58, SLOW.name: 0.9}
    chip = FakeChip(burst=first, sustained=first)
    outcome, asked, timings = _select(monkeypatch, first, wrong={TILES[0].name}, chip=chip)
    assert asked[:3] == [TILES[0].name, TILES[1].name, ATEN.name]       # the fastest first: the regime is its
    assert TILES[0].name not in chip.windows and set(chip.windows) == {ATEN.name, TILES[1].name}
    assert timings[TILES[0].name].startswith("wrong result") and outcome.winner == TILES[1].name


def test_a_baseline_that_fails_verification_hands_the_part_to_the_next_simplest(monkeypatch):
    first = {ATEN.name: 0.60, TILES[0].name: 0.58, TILES[1].name: 0.59}
    chip = FakeChip(burst=first, sustained=first)
    outcome, asked, timings = _select(monkeypatch, first, wrong={ATEN.name}, chip=chip)
    assert ATEN.name in asked and timings[ATEN.name].startswith("wrong result")
    assert outcome.winner in (TILES[0].name, TILES[1].name) and ATEN.name not in chip.windows


def test_every_candidate_failing_verification_leaves_no_winner(monkeypatch):
    first = {ATEN.name: 0.60, TILES[0].name: 0.58}
    outcome, asked, timings = _select(monkeypatch, first, wrong=set(first), chip=FakeChip(first, first))
    assert outcome.winner is None and sorted(asked) == sorted(first)
    assert all(timings[n].startswith("wrong result") for n in first)


def test_contenders_that_all_fail_verification_keep_the_baseline_without_a_duel(monkeypatch):
    first = {ATEN.name: 0.60, TILES[0].name: 0.58, TILES[1].name: 0.59, SLOW.name: 0.9}
    chip = FakeChip(burst=first, sustained=first)
    outcome, asked, timings = _select(monkeypatch, first, wrong={TILES[0].name, TILES[1].name}, chip=chip)
    assert outcome.winner == ATEN.name and chip.windows == []
    assert all(timings[n].startswith("wrong result") for n in (TILES[0].name, TILES[1].name))
    assert any("none ran" in n for n in outcome.notes)


def test_a_contender_failing_verification_inside_the_duel_hands_over_to_the_next(monkeypatch):
    """Below the fastest three: verified when its turn comes (the crash-fallback path of _duels)."""
    first = {ATEN.name: 0.60, TILES[0].name: 0.57, TILES[1].name: 0.58, TILES[2].name: 0.59}
    chip = FakeChip(burst=first, sustained=first)
    names = {c.name: c for c in [ATEN, *TILES]}
    checked, asked = [], []

    def check(name):
        asked.append(name)
        return name != TILES[0].name
    fr.plan_for, saved = (lambda device: PLAN), fr.plan_for
    try:
        winner, regime, finalists = fr.pick_winner(dict(first), names, {n: n for n in first}, 1, "cuda",
                                                   {n: {} for n in first}, checked, windows=lambda fns: chip,
                                                   check=check)
    finally:
        fr.plan_for = saved
    assert regime == "steady" and asked == [ATEN.name, TILES[0].name, TILES[1].name]
    assert TILES[0].name not in chip.windows and winner == TILES[1].name


def test_a_burst_problem_verifies_every_candidate_before_its_final_round(monkeypatch):
    first = {ATEN.name: 0.020, TILES[0].name: 0.010, TILES[1].name: 0.015, SLOW.name: 0.05}
    outcome, asked, timings = _select(monkeypatch, first, wrong={TILES[0].name}, device="cpu")
    assert sorted(asked) == sorted(first)
    assert outcome.regime == "burst" and outcome.winner == TILES[1].name
    assert TILES[0].name not in outcome.finalists and timings[TILES[0].name].startswith("wrong result")
    assert not any(isinstance(t, str) and t.startswith(fr.NOT_VERIFIED) for t in timings.values())


def test_verification_inside_the_final_round_is_counted_to_itself():
    """Stages add up to the tune: a nested stage's seconds leave the outer one's."""
    import time

    clock = fr.StageClock()
    with clock("final_round"):
        time.sleep(0.02)
        with clock("verify"):
            time.sleep(0.05)
    assert clock.seconds["verify"] >= 0.05 and 0.015 <= clock.seconds["final_round"] < 0.045
    announced = []
    clock = fr.StageClock(announced.append)
    with clock("final_round"), clock("verify"):
        pass
    assert announced == ["final_round", "verify", "final_round"]


# -- the isolated child's side ---------------------------------------------------------------------------------------
def _child_answers(capsys, timed_ms: dict[str, float], wrong=(), keep=1):
    asked = []

    def verify(name):
        asked.append(name)
        return "wrong result: x" if name in wrong else None
    timed = {n: Timing(ms, ms, ms, 5, 1) for n, ms in timed_ms.items()}
    status = isolated_child._verify_fastest_first(timed, verify, keep, lambda: True)
    answers, in_flight = isolated_child._parse(capsys.readouterr().out)
    return status, asked, answers, in_flight


def test_the_child_verifies_fastest_first_until_enough_pass_when_the_caller_duels(capsys):
    timed = {"a": 0.5, "b": 0.3, "c": 0.4, "d": 0.45, "e": 0.6}
    status, asked, answers, in_flight = _child_answers(capsys, timed, wrong={"b"}, keep=2)
    assert status == 0 and asked == ["b", "c", "d"] and in_flight is None
    assert answers["b"]["error"] == "wrong result: x" and not any("unverified" in answers[n] for n in ("c", "d"))
    assert answers["a"]["unverified"] is True and answers["a"]["timing"]["median_ms"] == 0.5
    assert answers["e"]["unverified"] is True


def test_the_child_verifies_every_candidate_otherwise(capsys):
    status, asked, answers, _ = _child_answers(capsys, {"a": 0.05, "b": 0.03}, keep=None)
    assert asked == ["b", "a"] and not any(a.get("unverified") for a in answers.values())


def test_a_child_that_dies_while_verifying_blames_that_candidate():
    tag = isolated_child.TAG
    out = "\n".join([tag + '{"start": "a"}', tag + '{"timed": "a"}', tag + '{"start": "b"}', tag + '{"timed": "b"}',
                     tag + '{"start": "b"}'])
    answers, in_flight = isolated_child._parse(out)
    assert answers == {} and in_flight == "b"
    assert isolated_child._parse("\n".join(out.split("\n")[:4]))[1] is None     # timed, not yet verified: no culprit


def test_only_gpu_bound_calls_on_both_sides_mean_a_duel():
    t = {"x": Timing(0.2, 0.2, 0.2, 5, 1)}
    assert isolated_child._duel_only(0.15, t, "cuda")
    assert not isolated_child._duel_only(0.05, t, "cuda")           # the caller's fastest is a burst call
    assert not isolated_child._duel_only(None, t, "cuda")
    assert not isolated_child._duel_only(0.15, {"x": Timing(0.09, 0.09, 0.09, 5, 1)}, "cuda")
    assert not isolated_child._duel_only(0.15, t, "cpu")


def test_the_parent_reads_an_unverified_answer_as_such():
    msg = {"name": "a", "timing": Timing(0.5, 0.4, 0.6, 5, 1).as_dict(), "unverified": True}
    answers, _ = isolated_child._parse(isolated_child.TAG + json.dumps(msg))
    assert answers["a"]["unverified"] is True


# -- the compact reference -------------------------------------------------------------------------------------------
def _problem(op, dtype, m=48, n=40, k=64):
    a = torch.zeros(m, k, dtype=dtype)
    b = torch.zeros(k, n, dtype=dtype)
    return GemmProblem.from_tensors(op, a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_compact_check_agrees_with_a_float64_one(dtype):
    p = _problem("mm", dtype)
    a, b = make_inputs(p, "cpu", seed=3)
    exact = reference(p, a, b)
    ref = prepare_reference(p, exact)
    assert isinstance(ref, Reference) and ref.values.dtype == torch.float32
    out = torch.mm(a.float(), b.float()).to(dtype)
    for scale in (1.0, 1.001, 1.02, 1.3):
        got = check(p, out * scale if scale != 1.0 else out, ref)
        want = float(torch.linalg.vector_norm((out * scale if scale != 1.0 else out).double() - exact)
                     / torch.linalg.vector_norm(exact))
        assert got.rel_error == pytest.approx(want, rel=1e-3, abs=1e-7)
        assert got.ok == (want <= (1e-5 if dtype == torch.float32 else 1e-2))
    assert check(p, out, exact).ok                       # a raw float64 reference is still taken


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_unwritten_or_overflowed_element_fails_the_check(bad):
    p = _problem("mm", torch.bfloat16)
    a, b = make_inputs(p, "cpu", seed=4)
    ref = prepare_reference(p, reference(p, a, b))
    out = torch.mm(a, b)
    out[7, 3] = bad
    got = check(p, out, ref)
    assert not got.ok and "NaN/inf" in got.message


def test_int_results_compare_exactly():
    p = _problem("int_mm", torch.int8)
    a, b = make_inputs(p, "cpu", seed=5)
    ref = prepare_reference(p, reference(p, a, b))
    assert ref.values.dtype == torch.int32
    out = torch.mm(a.int(), b.int())
    assert check(p, out, ref).ok
    out[0, 0] += 1
    got = check(p, out, ref)
    assert not got.ok and "exact integer product" in got.message and got.rel_error > 0
    assert not check(p, torch.full_like(out, torch.iinfo(torch.int32).min), ref).ok      # the poisoned output


def test_an_int_result_beyond_int32_can_match_no_int32_output():
    p = _problem("int_mm", torch.int8, m=2, n=2, k=2)
    exact = torch.tensor([[2.0 ** 31, 1.0], [0.0, -1.0]], dtype=torch.float64)
    ref = prepare_reference(p, exact)
    assert ref.values.dtype == torch.float64
    wrapped = torch.tensor([[-2 ** 31, 1], [0, -1]], dtype=torch.int32)
    assert not check(p, wrapped, ref).ok


def test_prepare_reference_takes_the_float64_result_only():
    p = _problem("mm", torch.bfloat16)
    with pytest.raises(TypeError, match="float64"):
        prepare_reference(p, torch.zeros(48, 40, dtype=torch.float32))


def test_a_wrong_but_fast_candidate_cannot_set_the_first_pass_screen():
    """The screen stops candidates slower than QUICK_SCREEN times the fastest one-call estimate; that estimate must be
    a verified candidate's, or a kernel fast for skipping work would leave the right ones one call each."""
    import time

    from kernels.measure.timing import measure_interleaved

    def call(ms):
        return lambda i: time.sleep(ms / 1e3)
    # sleeps overshoot on a loaded machine by a millisecond or more: the checked and the unchecked verdicts both need
    # margins wider than that (a 3x screen over 6 ms, the wrong one 60x faster than the right ones)
    calls = {"wrong": call(0.1), "good": call(6.0), "close": call(6.5)}
    timed, failed = measure_interleaved(calls, 1, "cpu", 120.0, screen=3.0, trusted=lambda n: n != "wrong")
    assert "wrong" not in timed and "wrong" not in failed
    assert timed["good"].samples > 1 and timed["close"].samples > 1        # measured, not screened out
    timed, _ = measure_interleaved(calls, 1, "cpu", 120.0, screen=3.0)
    assert timed["good"].samples == 1 and timed["close"].samples == 1      # what the wrong one did unchecked


def test_finite_values_too_far_off_for_a_float32_norm_are_named_as_such():
    p = _problem("mm", torch.float32)
    a, b = make_inputs(p, "cpu", seed=6)
    ref = prepare_reference(p, reference(p, a, b))
    out = torch.mm(a, b)
    out[0, 0] = out[1, 1] = 3e38
    got = check(p, out, ref)
    assert not got.ok and "beyond float32's range" in got.message


def test_the_isolated_child_is_asked_after_this_process_fastest_is_verified(monkeypatch):
    """The child's cutoffs and screen start from this process's fastest first pass (autotune.measure_isolated
    reads it from `timings`): a wrong one must be a failure there by then."""
    first = {ATEN.name: 0.60, TILES[0].name: 0.30, TILES[1].name: 0.58}
    monkeypatch.setattr(fr, "measure_interleaved", lambda calls, *a, **k: (
        {n: Timing(first[n], first[n], first[n], 5, 1) for n in calls}, {}))
    monkeypatch.setattr(fr, "plan_for", lambda device: PLAN)
    timings: dict = {}
    seen = []

    def isolated(may_leave: bool):
        assert not may_leave          # no duel deferred to calls here
        seen.append(min(t for t in timings.values() if isinstance(t, float)))
        return {}
    outcome = fr.select({n: n for n in first}, {c.name: c for c in [ATEN, *TILES]}, 1, "cuda", 40.0,
                        isolated=isolated, timings=timings, windows=lambda fns: FakeChip(first, first),
                        verify=lambda n: "wrong result: x" if n == TILES[0].name else None)
    assert seen == [0.58] and timings[TILES[0].name] == "wrong result: x" and outcome.winner != TILES[0].name
