"""kernels.tune.build_ahead: the problems a caller names with `coming` are built in the background once the next
tune's own build is done -- once, for the backends that build ahead, skipping those that need no tune."""
import threading

from kernels.tune import build_ahead
from tests.helpers import problem

FWD, DX, DW = problem(m=64), problem(m=64, lb="col"), problem(n=64, la="col")


class Recorder:
    def __init__(self, fail=False):
        self.calls, self.done, self.fail = [], threading.Event(), fail

    def __call__(self, problems, backends):
        self.calls.append((list(problems), backends))
        self.done.set()
        if self.fail:
            raise RuntimeError("compile pool gone")


def test_nothing_starts_without_problems_coming():
    assert build_ahead.start_after_build(Recorder()) is None


def test_the_next_build_starts_the_coming_problems_once():
    record = Recorder()
    with build_ahead.coming([DX, DW], ("aten", "triton", "cutlass", "padded")):
        thread = build_ahead.start_after_build(record)
        assert thread is not None and thread.daemon
        thread.join(10)
        assert build_ahead.start_after_build(record) is None        # a later tune in the block: nothing left
    # the ahead builders only: aten builds nothing, CUTLASS has its own background build
    assert record.calls == [([DX, DW], ("triton", "padded"))]
    assert build_ahead.start_after_build(record) is None            # the block is over


def test_problems_that_need_no_tune_are_not_built():
    record = Recorder()
    with build_ahead.coming([DX, DW], ("triton",), needed=lambda p: p is DW):
        build_ahead.start_after_build(record).join(10)
    assert record.calls == [([DW], ("triton",))]
    record = Recorder()
    with build_ahead.coming([DX], ("triton",), needed=lambda p: False):
        build_ahead.start_after_build(record).join(10)
    assert record.calls == []


def test_blocks_nest_and_other_threads_see_none_of_them():
    record = Recorder()
    with build_ahead.coming([DX], ("triton",)):
        with build_ahead.coming([DW], ("triton",)):
            seen = []
            other = threading.Thread(target=lambda: seen.append(build_ahead.start_after_build(record)))
            other.start()
            other.join(10)
            assert seen == [None]
        build_ahead.start_after_build(record).join(10)              # the outer block's problems are still coming
    assert record.calls == [([DX], ("triton",))]


def test_no_backend_that_builds_ahead_starts_nothing_and_a_failure_stays_in_the_thread():
    with build_ahead.coming([DX], ("aten", "cutlass")):
        assert build_ahead.start_after_build(Recorder()) is None
    record = Recorder(fail=True)
    with build_ahead.coming([DX], ("triton",)):
        build_ahead.start_after_build(record).join(10)
    assert record.done.is_set()
