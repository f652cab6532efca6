"""Isolated measurement (backends/isolated_child.py) end to end on CPU: Triton candidates verified and timed in a
child process through the interpreter, and a candidate whose child dies (fault injection) loses without taking the
caller down. On the GPU the same path guards against illegal-address faults (tests/gpu/test_cutlass.py)."""
import re

import pytest
import torch

import kernels
from backends import child_handle, isolated_child
from backends.triton import TritonBackend
from kernels.core.config import interpret_mode
from kernels.core.problem import GemmProblem
from tests.triton_helpers import assert_close, operand

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not interpret_mode(),
                                reason="needs a GPU, or TRITON_INTERPRET=1 (set on machines without CUDA)")


def operands(m, k, n, lb):
    return operand(m, k, "row", torch.float16).to(DEVICE), operand(k, n, lb, torch.float16).to(DEVICE)


def two_triton_choices(a, b) -> list[str]:
    choices, _ = TritonBackend().choices(GemmProblem.from_tensors("mm", a, b))
    names = [c.name for c in choices if c.template == "triton_mm"][:2]
    assert len(names) == 2
    return names


@pytest.fixture
def isolated_triton(isolated_cache, monkeypatch):
    kernels.config.backends = ("triton",)
    monkeypatch.setattr(TritonBackend, "isolated", True)
    kernels.config.bench_budget_ms = 2.0


def test_isolated_triton_candidates_are_measured_in_a_child(isolated_triton):
    a, b = operands(17, 65, 33, "col")
    names = two_triton_choices(a, b)
    kernels.config.only = "|".join("^" + re.escape(n) + "$" for n in names)
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert sel.winner in names
    for n in names:
        assert isinstance(sel.timings[n], float), sel.timings[n]
        assert sel.details[n]["measured_in"] == "child"


def test_a_candidate_whose_child_dies_loses_and_the_caller_goes_on(isolated_triton, monkeypatch):
    a, b = operands(20, 48, 24, "row")
    names = two_triton_choices(a, b)
    kernels.config.only = "|".join("^" + re.escape(n) + "$" for n in names)
    monkeypatch.setattr(isolated_child, "FAULT_INJECTION", names[0])    # the child SIGSEGVs when it starts this one
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert sel.winner == names[1]
    assert sel.timings[names[0]].startswith("crashed: isolated child exited with status"), sel.timings[names[0]]
    assert isinstance(sel.timings[names[1]], float)          # measured by a fresh child after the crash
    assert_close(kernels.mm(a, b), a, b)                     # this process is unharmed


def test_padded_triton_choices_inherit_isolation(isolated_triton):
    kernels.config.backends = ("padded",)
    a, b = operands(17, 65, 33, "row")     # misaligned rows
    kernels.config.only = "^padded_aten_mm$|^padded_triton_mm_"
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    timed = {n for n, t in sel.timings.items() if isinstance(t, float)}
    triton = {n for n in timed if n.startswith("padded_triton_mm_")}
    assert triton and "padded_aten_mm" in timed
    assert all(sel.details[n]["measured_in"] == "child" for n in triton)
    assert sel.details["padded_aten_mm"].get("measured_in") != "child"


def test_one_child_serves_every_tune_of_the_process(isolated_triton):
    """The child's start (a process, torch, a CUDA context: 5-7 s a tune on the H100) is paid once per process."""
    pids = []
    for m, k, n in ((17, 65, 33), (19, 40, 24)):
        a, b = operands(m, k, n, "col")
        names = two_triton_choices(a, b)
        kernels.config.only = "|".join("^" + re.escape(x) + "$" for x in names)
        assert_close(kernels.mm(a, b), a, b)
        assert all(kernels.explain(a, b).details[x]["measured_in"] == "child" for x in names)
        pids.append(child_handle.current().proc.pid)
    assert pids[0] == pids[1] and child_handle.current().proc.poll() is None
    child_handle.close()
    assert child_handle.current() is None


def test_a_prestarted_child_warms_up_then_serves_the_first_tune(isolated_triton):
    """A tuning worker starts its child warming up at once (CUDA context, cuBLAS); the warm-up's answer must not be
    taken for the first request's."""
    child_handle.close()
    child_handle.prestart(0)
    pid = child_handle.current().proc.pid
    assert child_handle.warmed(timeout_s=120) == "done"
    a, b = operands(17, 65, 33, "col")
    names = two_triton_choices(a, b)
    kernels.config.only = "|".join("^" + re.escape(x) + "$" for x in names)
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert all(isinstance(sel.timings[x], float) and sel.details[x]["measured_in"] == "child" for x in names)
    assert child_handle.current().proc.pid == pid
    child_handle.close()


def test_a_tune_right_after_prestart_waits_for_the_warm_up_answer(isolated_triton):
    """The warm-up's `done` comes first on the child's output: a tune sent while it is pending must not take it."""
    child_handle.close()
    child_handle.prestart(0)
    a, b = operands(18, 40, 24, "col")
    names = two_triton_choices(a, b)
    kernels.config.only = "|".join("^" + re.escape(x) + "$" for x in names)
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert all(isinstance(sel.timings[x], float) and sel.details[x]["measured_in"] == "child" for x in names), \
        sel.timings
    assert not child_handle.current().warming
    child_handle.close()


def test_a_child_that_dies_warming_up_is_replaced_for_the_first_tune(isolated_triton):
    child_handle.close()
    child_handle.prestart(0)          # not waited for: the first tune settles the warm-up itself
    dead = child_handle.current().proc
    dead.kill()
    a, b = operands(19, 40, 24, "col")
    names = two_triton_choices(a, b)
    kernels.config.only = "|".join("^" + re.escape(x) + "$" for x in names)
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert all(isinstance(sel.timings[x], float) for x in names), sel.timings
    assert child_handle.current().proc.pid != dead.pid
    child_handle.close()


def test_scaled_mm_candidates_are_verified_and_timed_with_their_operand_tuple(isolated_triton):
    """scaled_mm's launches take (a, b, scale_a, scale_b[, bias], out): the child makes that tuple (make_inputs),
    checks it against the float64 reference (scales and bias applied) and times it, as for CUTLASS's fp8 kernels."""
    a = torch.randn(17, 64).to(torch.float8_e4m3fn).to(DEVICE)
    b = torch.randn(32, 64).to(torch.float8_e4m3fn).to(DEVICE).t()
    scale_a, scale_b = torch.rand(17, 1, device=DEVICE) + 0.5, torch.rand(1, 32, device=DEVICE) + 0.5
    bias = torch.randn(32, device=DEVICE).to(torch.bfloat16)
    problem = GemmProblem.from_tensors("scaled_mm", a, b, bias=True, scaling="row", out_dtype="bf16")
    choices, _ = TritonBackend().choices(problem)
    names = [c.name for c in choices if c.template == "triton_scaled_mm"][:2]
    assert len(names) == 2
    kernels.config.only = "|".join("^" + re.escape(n) + "$" for n in names)
    out = kernels.scaled_mm(a, b, scale_a, scale_b, bias=bias)
    ref = (a.double() @ b.double()) * scale_a.double() * scale_b.double() + bias.double()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    sel = kernels.explain(a, b, op="scaled_mm", scale_a=scale_a, scale_b=scale_b, bias=bias)
    for n in names:
        assert isinstance(sel.timings[n], float), sel.timings[n]
        assert sel.details[n]["measured_in"] == "child"


def test_the_first_tune_starts_the_child_before_its_in_process_work(isolated_triton, monkeypatch):
    """The child's start-up (5 s on the H100) overlaps the in-process build, verification and first pass: it is
    started as soon as the isolated backend has built (isolated backends build first), and asked after the first
    pass."""
    from kernels.tune import autotune

    child_handle.close()
    events = []
    prestart, verify = child_handle.prestart, autotune.verify_launch
    monkeypatch.setattr(child_handle, "prestart", lambda device=None: (events.append("prestart"), prestart(device)))
    monkeypatch.setattr(autotune, "verify_launch", lambda *a: (events.append("verify"), verify(*a))[1])
    kernels.config.backends = ("aten", "triton")
    a, b = operands(17, 65, 33, "col")
    names = two_triton_choices(a, b)
    kernels.config.only = "|".join("^" + re.escape(x) + "$" for x in names)
    assert_close(kernels.mm(a, b), a, b)
    sel = kernels.explain(a, b)
    assert events[0] == "prestart" and events.count("prestart") == 1 and "verify" in events     # aten, in-process
    stages = list(sel.stage_seconds)
    assert stages.index("build") < stages.index("verify") < stages.index("first_pass") < stages.index("isolated")
    assert all(sel.details[x]["measured_in"] == "child" for x in names) and isinstance(sel.timings["aten_mm"], float)
    child_handle.close()
