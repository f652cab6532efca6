"""kernels.core.fsutil.load_or_build: the one lifecycle of every cached thing (load -> lock -> load -> build); and
build_each_once, its batch form for artifacts several processes need at once."""
import contextlib
import multiprocessing
import threading
import time
from pathlib import Path

from kernels.core.fsutil import build_each_once, file_lock, load_or_build
from tests.helpers import eventually


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


# -- build_each_once: per-key builds shared by processes that need overlapping sets at once ------------------------
def _batch_worker(root: str, keys: list[str], out: "multiprocessing.Queue") -> None:
    base = Path(root)

    def build(batch: list[str]) -> None:
        with open(base / "builds.txt", "a") as f:
            f.write("".join(f"{k}\n" for k in batch))
        time.sleep(0.4)                      # long enough that the other process meets these keys' locks held
        for k in batch:
            if k != "fails":
                (base / f"{k}.built").write_text("ok")

    out.put(build_each_once(keys, lambda k: base / "locks" / f"{k}.lock", lambda k: (base / f"{k}.built").exists(),
                            build))


def test_two_processes_needing_the_same_artifacts_build_each_once(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_batch_worker, args=(str(tmp_path), keys, out))
             for keys in (["a", "b", "c"], ["c", "b", "d"])]
    for p in procs:
        p.start()
    built_here = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    builds = (tmp_path / "builds.txt").read_text().split()
    assert sorted(builds) == ["a", "b", "c", "d"]               # b and c: built by whichever locked them first
    assert sorted(k for here in built_here for k in here) == ["a", "b", "c", "d"]
    assert all((tmp_path / f"{k}.built").exists() for k in "abcd")


def test_a_key_the_other_process_left_unbuilt_is_built_after_waiting(tmp_path):
    base = tmp_path
    calls = []

    def build(batch):
        calls.append(list(batch))
        for k in batch:
            (base / f"{k}.built").write_text("ok")

    with file_lock(base / "locks" / "x.lock"):                  # "another process" holds x, then dies unbuilt
        result = {}
        t = threading.Thread(target=lambda: result.setdefault("keys", build_each_once(
            ["w", "x"], lambda k: base / "locks" / f"{k}.lock", lambda k: (base / f"{k}.built").exists(), build)))
        t.start()
        assert eventually(lambda: calls == [["w"]])            # its own key first, without waiting for x
        assert calls == [["w"]]
    t.join(30)
    assert calls == [["w"], ["x"]] and result["keys"] == ["w", "x"]


def test_nothing_is_built_when_everything_is_built(tmp_path):
    def build(batch):
        raise AssertionError(f"built {batch}")

    assert build_each_once(["a", "b"], lambda k: tmp_path / f"{k}.lock", lambda k: True, build) == []


def test_a_key_held_past_the_lock_timeout_is_built_here_rather_than_failed(tmp_path, monkeypatch):
    import kernels.core.fsutil as fsutil
    monkeypatch.setattr(fsutil, "LOCK_TIMEOUT_S", 0.3)
    real = fsutil.file_lock
    monkeypatch.setattr(fsutil, "file_lock", lambda path, timeout_s=None: real(
        path, fsutil.LOCK_TIMEOUT_S if timeout_s is None else timeout_s))
    built = []
    with file_lock(tmp_path / "x.lock"):                          # a stuck holder
        assert fsutil.build_each_once(["x"], lambda k: tmp_path / f"{k}.lock", lambda k: False,
                                      built.extend) == ["x"]
    assert built == ["x"]
