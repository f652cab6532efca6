"""Faults a probe planted in the store, each a miss or a repair, never a crash nor a lost result: bucket decisions with
fields of the wrong types, a selection dated in the far future, a redis key of another type under an entry's name,
a directory where an entry's file (or a plain file where the store's folder) belongs, a lock whose holder is stuck,
and a directory at a lock's path."""
import json
import os
import time
import warnings
from pathlib import Path

import pytest
import torch

import kernels
from kernels.core import counters, fsutil
from kernels.core.cache_root import CacheWarning
from kernels.core.choice import Choice
from kernels.core.selection import Selection
from kernels.store import cache_admin, entries, shared
from kernels.store.buckets import BucketStore, entry_problem
from kernels.store.schema import problems
from kernels.store.selections import SelectionStore
from kernels.store.shared import SharedStore
from tests.helpers import problem

KEY = '{"env": {"test": 1}, "problem": "p"}'


pytestmark = pytest.mark.usefixtures("fresh_cache_checks")       # conftest.py: the cache's checks made anew


def _ours(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]


def selection(created: float, m=24) -> Selection:
    p = problem(m=m, n=16, k=40, dtype="fp16", arch=0)
    return Selection(problem=p, winner="aten_mm", choices={"aten_mm": Choice("aten", "aten_mm", p.dtype)},
                     timings={"aten_mm": 0.01}, created=created)


def _mm_ok(m=24) -> None:
    a, b = torch.randn(m, 40), torch.randn(40, 8)
    assert torch.allclose(kernels.mm(a, b), a @ b, atol=1e-5)


def _stored_entry(cache: Path) -> Path:
    files = sorted((cache / "selections").glob("*.json"))
    assert len(files) == 1
    return files[0]


# -- 1. bucket decisions: an entry whose fields have the wrong types is a miss ----------------------------------------
GOOD_BUCKET = {"winner": "aten_mm", "timings": {"aten_mm": 0.04, "t": "not a finalist"}, "measured_at": [24, 8, 40],
               "edge_timings": {"17x8x40": {"aten_mm": 0.03}}, "worst_ratio": {"aten_mm": 1.0}, "seconds": 0.3,
               "created": 1.7e9}
BAD_FIELDS = [("timings", []), ("timings", {"aten_mm": [1]}), ("timings", {"aten_mm": 0}), ("edge_timings", []),
              ("edge_timings", {"17x8x40": []}), ("edge_timings", {"17x8": {}}), ("edge_timings", {"ax8x40": {}}),
              ("worst_ratio", 3), ("worst_ratio", "x"), ("worst_ratio", []), ("worst_ratio", None),
              ("worst_ratio", {"aten_mm": "1"}), ("measured_at", 24), ("measured_at", "24x8x40"),
              ("measured_at", ["24", "8", "40"]), ("measured_at", [24, 8]), ("measured_at", [0, 8, 40]),
              ("seconds", "0.3"), ("seconds", None), ("seconds", float("nan")), ("created", "today"),
              ("winner", 3)]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_a_bucket_decision_with_fields_of_the_wrong_type_is_a_miss(tmp_path, field, value):
    store = BucketStore(tmp_path)
    store.write("k", {"schema": 1, "winners": ["aten_mm"],
                      "buckets": {"good": GOOD_BUCKET, "bad": dict(GOOD_BUCKET, **{field: value})}})
    assert entry_problem(GOOD_BUCKET) is None and entry_problem(dict(GOOD_BUCKET, **{field: value}))
    assert set(store.load("k", ["aten_mm"])) == {"good"}           # the bad bucket is benchmarked again


def test_cache_verify_names_a_malformed_bucket_and_fix_removes_its_file(isolated_cache):
    store = BucketStore()
    store.write("k", {"schema": 1, "winners": ["aten_mm"], "buckets": {"b": dict(GOOD_BUCKET, timings=[])}})
    report = cache_admin.verify()
    assert [(b.what, b.path) for b in report.bad] == [("bucket decisions", store.path("k"))]
    assert "timings" in report.bad[0].why
    assert cache_admin.verify(fix=True).removed == 1 and not store.path("k").exists()
    store.write("k", {"schema": 1, "winners": ["aten_mm"], "buckets": {"b": GOOD_BUCKET}})
    assert cache_admin.verify().bad == []


# -- 2. a selection dated in the far future ---------------------------------------------------------------------------
def test_a_selection_created_far_in_the_future_is_refused_and_listing_never_dies(isolated_cache):
    as_stored = lambda created: json.loads(json.dumps(selection(created).to_dict()))     # noqa: E731
    assert "future" in problems(as_stored(1e30)) and problems(as_stored(1e9)) is None
    _mm_ok()
    path = _stored_entry(isolated_cache)
    data = json.loads(path.read_text())
    data["selection"]["created"] = 1e30
    path.write_text(json.dumps(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert SelectionStore().get(data["key"]) is None
        assert "unreadable or invalid" in cache_admin.list_lines()[-1]
        kernels.clear_memory_cache()
        _mm_ok()                                               # re-tuned, and the entry replaced
    assert json.loads(path.read_text())["selection"]["created"] < 1e30


@pytest.mark.parametrize("created", [1e30, float("inf"), float("nan"), -1e20, 1e300])
def test_a_date_no_clock_can_show_is_listed_as_unknown(created):
    assert cache_admin._when(created).strip() == "unknown"


def test_a_shared_entry_dated_in_the_far_future_is_replaced_by_a_real_tune(redis_server):
    client = redis_server.client()
    store = SharedStore(redis_server.url, lock_s=5)
    valid_but_future = {"key": KEY, "created": 1e30, "selection": selection(1e30).to_dict()}
    outer_only = {"key": KEY, "created": 1e30, "selection": selection(100.0).to_dict()}
    for body in (valid_but_future, outer_only):
        client.set(shared.KEY_PREFIX + shared._digest(KEY), json.dumps(body))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CacheWarning)
            assert store.get(KEY) is None
        assert store.publish(KEY, selection(1.0))
        assert store.get(KEY).created == 1.0


# -- 3. redis: a key of another type under an entry's name is a bad entry, not an outage -------------------------------
@pytest.mark.parametrize("plant", ["list", "hash", "set"])
def test_a_redis_key_of_the_wrong_type_is_a_miss_and_the_next_publish_replaces_it(redis_server, plant):
    client = redis_server.client()
    name = shared.KEY_PREFIX + shared._digest(KEY)
    {"list": lambda: client.rpush(name, "a", "b"), "hash": lambda: client.hset(name, "a", "b"),
     "set": lambda: client.sadd(name, "a")}[plant]()
    store = SharedStore(redis_server.url, lock_s=5)
    errors = counters.snapshot()["store_errors"]
    other = '{"env": {"test": 1}, "problem": "another"}'
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.get(KEY) is None
        assert store.publish(other, selection(5.0, m=32))         # the store is not marked down: others go on
        assert store.get(other).problem.m == 32
        assert store.publish(KEY, selection(1.0))                 # the bad key is replaced
    assert store.get(KEY).created == 1.0 and client.type(name) == b"string"
    assert counters.snapshot()["store_errors"] == errors
    assert len(_ours(caught)) == 1 and "bad entry" in _ours(caught)[0] and "failed" not in _ours(caught)[0]


@pytest.mark.parametrize("plant", ["list", "string without an expiry"])
def test_something_at_a_tuning_locks_key_that_is_no_lock_is_cleared_not_waited_on(redis_server, plant):
    """A lock is a string with an expiry; a list, or a string that never expires, at its key never lapses: every
    machine waited KERNELS_STORE_WAIT on the problem, for good. It is deleted and the lock claimed at once."""
    client = redis_server.client()
    name = shared.LOCK_PREFIX + shared._digest(KEY)
    {"list": lambda: client.rpush(name, "a"), "string without an expiry": lambda: client.set(name, "x")}[plant]()
    store = SharedStore(redis_server.url, lock_s=5)
    start = time.monotonic()
    assert store.tune_once(KEY, lambda: None, lambda: "built", wait_s=10) == "built"
    assert time.monotonic() - start < 5 and client.exists(name) == 0      # claimed, built, released


# -- 4. a directory where an entry's file belongs, a plain file where the store's folder belongs -----------------------
def test_a_directory_at_a_selection_path_is_removed_and_the_entry_written(isolated_cache):
    _mm_ok()
    path = _stored_entry(isolated_cache)
    path.unlink()
    (path / "inner").mkdir(parents=True)
    kernels.clear_memory_cache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _mm_ok()
    assert path.is_file() and json.loads(path.read_text())["selection"]["winner"] == "aten_mm"
    assert not any("cannot write" in w for w in _ours(caught))
    assert any("removed a directory" in w and str(path) in w for w in _ours(caught))
    kernels.clear_memory_cache()
    before = kernels.stats()["tunes"]
    _mm_ok()
    assert kernels.stats()["tunes"] == before                    # read back: no process tunes it again


def test_a_plain_file_at_the_selections_folder_is_removed_and_the_entry_written(isolated_cache):
    (isolated_cache / "selections").write_text("not a folder")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _mm_ok()
    assert _stored_entry(isolated_cache).is_file()
    assert not any("cannot write" in w for w in _ours(caught))


def test_nothing_is_removed_from_a_users_folder_named_as_the_cache(isolated_cache):
    """KERNELS_CACHE_DIR names a folder of the user's (it holds more than kernels' entries, untagged): a file of
    theirs called `selections` stays, and the result is kept in memory; a link at selections/ is never followed."""
    (isolated_cache / "notes.txt").write_text("the user's")
    (isolated_cache / "selections").write_text("the user's too")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _mm_ok()
    assert (isolated_cache / "selections").read_text() == "the user's too"
    assert any("cannot make the lock" in w or "cannot write" in w for w in _ours(caught)), _ours(caught)


def test_a_link_where_the_stores_folder_belongs_is_left_alone(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("not a folder")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "selections").symlink_to(elsewhere)
    store = SelectionStore(tmp_path / "cache" / "selections")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert store.clear_the_way(store.path(KEY)) is False
    assert (tmp_path / "cache" / "selections").is_symlink() and elsewhere.read_text() == "not a folder"


def test_a_stray_directory_is_only_removed_at_the_entrys_own_path(tmp_path):
    store = SelectionStore(tmp_path / "selections")
    (tmp_path / "selections" / "neighbour.json").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        store.put(KEY, selection(1.0))
    assert store.get(KEY).winner == "aten_mm" and (tmp_path / "selections" / "neighbour.json").is_dir()


def test_cache_verify_names_what_stands_in_the_stores_way_and_fix_removes_it(isolated_cache):
    folder = isolated_cache / "selections"
    (folder / ("0" * 32 + ".json") / "x").mkdir(parents=True)
    (folder / "dynamic" / ("1" * 32 + ".json")).mkdir(parents=True)
    report = cache_admin.verify()
    assert sorted(b.path.name for b in report.bad) == ["0" * 32 + ".json", "1" * 32 + ".json"]
    assert cache_admin.verify(fix=True).removed == 2 and cache_admin.verify().bad == []
    os.rmdir(folder / "dynamic")
    os.rmdir(folder)
    folder.write_text("x")
    report = cache_admin.verify()
    assert [b.path for b in report.bad] == [folder]
    assert cache_admin.verify(fix=True).removed == 1 and not folder.exists()


# -- 5. a lock whose holder is alive but stuck ----------------------------------------------------------------------
@pytest.fixture
def short_lock_waits(monkeypatch):
    """LOCK_TIMEOUT_S 0.6 s, the slow-wait warning after 0.2 s; file_lock's default follows the constant."""
    monkeypatch.setattr(fsutil, "LOCK_TIMEOUT_S", 0.6)
    monkeypatch.setattr(entries, "SLOW_LOCK_WARN_S", 0.2)
    real = fsutil.file_lock
    monkeypatch.setattr(entries, "file_lock", lambda path, timeout_s=None: real(
        path, fsutil.LOCK_TIMEOUT_S if timeout_s is None else timeout_s))


def test_a_stuck_lock_holder_delays_a_call_with_two_warnings_then_it_tunes_unlocked(isolated_cache,
                                                                                   short_lock_waits):
    _mm_ok()
    path = _stored_entry(isolated_cache)
    path.unlink()
    kernels.clear_memory_cache()
    lock = isolated_cache / "selections" / "locks" / (path.stem + ".lock")
    with fsutil.file_lock(lock):                           # another process's stuck tune of the same problem
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _mm_ok()
    ours = _ours(caught)
    assert len(ours) == 2, ours
    assert "waited" in ours[0] and str(lock) in ours[0] and "tuning the same problem" in ours[0]
    assert "proceeding unlocked" in ours[1] and str(lock) in ours[1]
    assert path.is_file()                                   # and the result is kept


def test_a_lock_freed_during_the_long_wait_is_taken(tmp_path, short_lock_waits, monkeypatch):
    monkeypatch.setattr(fsutil, "LOCK_TIMEOUT_S", 30.0)
    store = SelectionStore(tmp_path)
    holder = fsutil.file_lock(store.lock_path(KEY))
    holder.__enter__()
    released = _ReleaseOnWarn(holder)
    monkeypatch.setattr(entries, "warnings", released)
    with store.lock(KEY):
        with pytest.raises(TimeoutError):                  # held here now: another taker times out
            with fsutil.file_lock(store.lock_path(KEY), timeout_s=0):
                pass
    assert len(released.messages) == 1 and "waited" in released.messages[0]     # the slow wait's line only


class _ReleaseOnWarn:
    """Stands in for the warnings module in kernels.store.entries: the slow-wait warning releases the holder."""

    def __init__(self, holder):
        self.holder, self.messages = holder, []

    def warn(self, message, *args, **kwargs):
        self.messages.append(message)
        self.holder.__exit__(None, None, None)


# -- 6. a directory at a lock's path -----------------------------------------------------------------------------------
def test_a_directory_at_a_lock_path_is_removed_and_no_warning_claims_results_are_lost(tmp_path):
    store = SelectionStore(tmp_path)
    store.lock_path(KEY).mkdir(parents=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with store.lock(KEY):
            store.put(KEY, selection(1.0))
    assert store.lock_path(KEY).is_file() and store.get(KEY).winner == "aten_mm"
    assert not any("kept in memory" in w for w in _ours(caught))


def test_a_lock_that_cannot_be_made_says_the_work_goes_on_unlocked(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(entries, "file_lock", refuse)
    store = SelectionStore(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with store.lock(KEY):
            store.put(KEY, selection(1.0))
    assert store.get(KEY).winner == "aten_mm"
    (warned,) = _ours(caught)
    assert "without it" in warned and str(store.lock_path(KEY)) in warned
