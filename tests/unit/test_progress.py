"""Long work shows progress on a terminal and nothing elsewhere (kernels.core.progress)."""
import io

import pytest

from kernels.core import progress
from kernels.tune.final_round import StageClock


def test_status_is_quiet_off_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())      # a file, not a terminal
    with progress.status("kernels: tuning") as update:
        update("kernels: tuning: build")
    assert progress.sys.stderr.getvalue() == ""


def test_every_tuning_stage_is_announced():
    seen = []
    clock = StageClock(seen.append)
    for stage in ("candidates", "build", "verify", "first_pass", "final_round"):
        with clock(stage):
            pass
    assert seen == ["candidates", "build", "verify", "first_pass", "final_round"]
    assert set(clock.seconds) == set(seen)


def test_status_updates_reach_rich_on_a_terminal(monkeypatch):
    updates = []

    class FakeStatus:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, text):
            updates.append(text)

    class FakeConsole:
        def __init__(self, stderr):
            assert stderr

        def status(self, text):
            updates.append(text)
            return FakeStatus()

    rich_console = pytest.importorskip("rich.console")
    monkeypatch.setattr(progress, "shown", lambda: True)
    monkeypatch.setattr(rich_console, "Console", FakeConsole)
    with progress.status("start") as update:
        update("build")
    assert updates == ["start", "build"]


def test_a_callers_bar_keeps_the_tuning_status_off_the_terminal(monkeypatch):
    monkeypatch.setattr(progress, "shown", lambda: True)
    with progress.held_by_caller():
        with progress.status("tuning") as update:
            assert update is progress._quiet


def test_a_bar_is_quiet_off_a_terminal(monkeypatch):
    monkeypatch.setattr(progress.sys, "stderr", io.StringIO())
    with progress.bar(3, "kernels compiled") as advance:
        advance(2)
    assert progress.sys.stderr.getvalue() == ""


def test_a_bar_without_rich_is_a_counter_line_cleared_at_the_end(monkeypatch):
    import sys

    stream = io.StringIO()
    monkeypatch.setattr(progress.sys, "stderr", stream)
    monkeypatch.setattr(progress, "shown", lambda: True)
    monkeypatch.setitem(sys.modules, "rich.progress", None)        # rich not installed
    with progress.bar(3, "kernels compiled") as advance:
        advance(1)
        advance(3)
        assert stream.getvalue().endswith("\r3/3 kernels compiled")
    assert stream.getvalue().endswith("\r")
