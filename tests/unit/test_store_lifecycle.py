"""kernels.core.fsutil.load_or_build: the one lifecycle of every cached thing (load -> lock -> load -> build)."""
import contextlib
import multiprocessing
import time
from pathlib import Path

from kernels.core.fsutil import file_lock, load_or_build


def test_a_hit_never_takes_the_lock_or_builds():
    def lock():
        raise AssertionError("a hit must not lock")

    assert load_or_build(lambda: "cached", lock, lambda: "built") == "cached"


def test_a_miss_builds_once_under_the_lock_and_rechecks_first():
    events = []
    answers = iter([None, "built meanwhile"])      # miss, then another process published while we waited

    @contextlib.contextmanager
    def lock():
        events.append("lock")
        yield
        events.append("unlock")

    def build():
        events.append("build")
        return "built here"

    assert load_or_build(lambda: next(answers), lock, build) == "built meanwhile"
    assert events == ["lock", "unlock"]
    assert load_or_build(lambda: None, lock, build) == "built here"
    assert events[2:] == ["lock", "build", "unlock"]


def _worker(root: str, out: "multiprocessing.Queue") -> None:
    entry, built = Path(root) / "entry.txt", Path(root) / "builds.txt"

    def load():
        return entry.read_text() if entry.exists() else None

    def build():
        with open(built, "a") as f:
            f.write("x")
        time.sleep(0.3)                      # long enough that the others queue on the lock
        entry.write_text("value")
        return "value"

    out.put(load_or_build(load, lambda: file_lock(Path(root) / "entry.lock", 30), build))


def test_concurrent_processes_build_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), out)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    assert results == ["value"] * 3
    assert (tmp_path / "builds.txt").read_text() == "x"
