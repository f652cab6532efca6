"""The shared selection store's protocol against a real redis-server (tests/redis_server.py): entries round-trip as
validated data, an older tune never replaces a newer one, bad values are ignored; one machine tunes while the others
wait and read its result; a tuner killed holding the lock holds the others up only for the lock's lifetime; a store
that is down, or dies mid-run, degrades to local work with one warning and never raises into the caller."""
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from kernels.core import counters
from kernels.core.cache_root import CacheWarning
from kernels.core.choice import Choice
from kernels.core.config import config
from kernels.core.errors import SettingError
from kernels.core.selection import Selection
from kernels.store import shared
from kernels.store.shared import SharedStore
from tests.helpers import REPO, problem

KEY = '{"env": {"test": 1}, "problem": "p"}'


def selection(created: float, winner="aten_mm", m=24) -> Selection:
    p = problem(m=m, n=16, k=40, dtype="fp16", arch=0)
    choices = {"aten_mm": Choice("aten", "aten_mm", p.dtype)}
    return Selection(problem=p, winner=winner, choices=choices, timings={"aten_mm": 0.01}, created=created)


def raw_key(key: str = KEY) -> str:
    return shared.KEY_PREFIX + shared._digest(key)


def test_a_published_selection_reads_back_as_data_from_the_shared_store(redis_server):
    store = SharedStore(redis_server.url, lock_s=5)
    assert store.get(KEY) is None
    before = counters.snapshot()["store_publishes"]
    assert store.publish(KEY, selection(100.0))
    got = store.get(KEY)
    assert got.winner == "aten_mm" and got.created == 100.0 and got.source == "shared"
    assert counters.snapshot()["store_publishes"] == before + 1


def test_an_older_tune_never_replaces_a_newer_one(redis_server):
    store = SharedStore(redis_server.url, lock_s=5)
    assert store.publish(KEY, selection(200.0, m=32))
    assert not store.publish(KEY, selection(100.0, m=48))          # older: kept out
    assert store.get(KEY).problem.m == 32
    assert store.publish(KEY, selection(300.0, m=64))              # newer: replaces
    assert store.get(KEY).problem.m == 64


@pytest.mark.parametrize("value", [b"not json", b'{"key": "%s", "selection": {"winner": 3}}',
                                   b'{"key": "another key", "selection": {}}', b"[1, 2]",
                                   b'{"key": "%s", "pad": "' + b"x" * (shared.MAX_ENTRY_BYTES + 1) + b'"}',
                                   # a bad entry dated in the far future: publish must not take its date for a tune's
                                   b'{"key": "%s", "created": 1e308, "selection": {"winner": 3}}',
                                   b'{"key": "another key", "created": 1e308}',
                                   b"[" * 100000 + b"]" * 100000],
                         ids=["not-json", "schema", "other-key", "not-object", "oversize", "future-bad",
                              "future-other-key", "deep"])
def test_bad_values_in_the_store_are_misses(redis_server, value):
    client = redis_server.client()
    client.set(raw_key(), value.replace(b"%s", KEY.replace('"', '\\"').encode()) if b"%s" in value else value)
    store = SharedStore(redis_server.url, lock_s=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert store.get(KEY) is None
    assert store.publish(KEY, selection(1.0))          # a bad value is replaced by the next tune's
    assert store.get(KEY).winner == "aten_mm"


def test_a_machine_waits_for_the_tuner_then_reads_its_result(redis_server):
    """Another machine holds the tuning lock; this one polls, and when the tuner publishes, reads it (no build)."""
    store = SharedStore(redis_server.url, lock_s=5)
    held = redis_server.client().lock(shared.LOCK_PREFIX + shared._digest(KEY), timeout=30, thread_local=False)
    assert held.acquire(blocking=False)

    def tuner():
        time.sleep(1.0)
        store.publish(KEY, selection(10.0))
        held.release()

    threading.Thread(target=tuner).start()
    built = []
    before = counters.snapshot()["store_waits"]
    start = time.monotonic()
    found = store.tune_once(KEY, lambda: store.get(KEY), lambda: built.append(1) or "built", wait_s=30)
    assert isinstance(found, Selection) and found.created == 10.0 and not built
    assert 0.8 < time.monotonic() - start < 10
    assert counters.snapshot()["store_waits"] == before + 1


def test_with_no_wait_a_held_lock_means_tune_here(redis_server):
    store = SharedStore(redis_server.url, lock_s=5)
    held = redis_server.client().lock(shared.LOCK_PREFIX + shared._digest(KEY), timeout=30)
    assert held.acquire(blocking=False)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert store.tune_once(KEY, lambda: None, lambda: "built", wait_s=0) == "built"
    assert time.monotonic() - start < 2


def test_the_tuner_holds_the_lock_while_it_tunes_and_frees_it_after(redis_server):
    store = SharedStore(redis_server.url, lock_s=1)
    client = redis_server.client()
    lock_key = shared.LOCK_PREFIX + shared._digest(KEY)

    def build():
        time.sleep(2.5)                     # past the lock's lifetime: the heartbeat keeps it
        return client.exists(lock_key)

    assert store.tune_once(KEY, lambda: None, build, wait_s=0) == 1
    assert not client.exists(lock_key)


HOLDER = textwrap.dedent("""
    import sys, time
    from kernels.store.shared import SharedStore
    def build():
        print("holding", flush=True)
        time.sleep(600)
    SharedStore(sys.argv[1], lock_s=1.5).tune_once(sys.argv[2], lambda: None, build, wait_s=0)
""")


def test_a_tuner_killed_holding_the_lock_holds_the_others_up_only_for_its_lifetime(redis_server):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, redis_server.url, KEY], stdout=subprocess.PIPE,
                              text=True, cwd=str(REPO))
    try:
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(3.5)                         # over twice the lifetime: renewed while the tuner lives
        store = SharedStore(redis_server.url, lock_s=1.5)
        with pytest.warns(CacheWarning, match="waited 0.5 s for another machine"):
            assert store.tune_once(KEY, lambda: None, lambda: "built", wait_s=0.5) == "built"
        lock_key = shared.LOCK_PREFIX + shared._digest(KEY)
        assert redis_server.client().exists(lock_key)       # (the waiter above timed out and built without it)
        holder.kill()
        holder.wait()
        start = time.monotonic()
        built = store.tune_once(KEY, lambda: None, lambda: "built after the lapse", wait_s=60)
        assert built == "built after the lapse" and time.monotonic() - start < 5
    finally:
        holder.kill()
        holder.wait()


def test_a_store_that_is_down_degrades_to_local_work_with_one_warning(redis_server):
    redis_server.kill()
    store = SharedStore(redis_server.url, lock_s=5)
    errors = counters.snapshot()["store_errors"]
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.get(KEY) is None
        assert store.tune_once(KEY, lambda: store.get(KEY), lambda: "built", wait_s=60) == "built"
        assert not store.publish(KEY, selection(1.0))
    assert time.monotonic() - start < 5
    mine = [w for w in caught if "shared store" in str(w.message)]
    assert len(mine) == 1 and redis_server.url.split("/")[2] in str(mine[0].message)
    assert counters.snapshot()["store_errors"] == errors + 1       # then skipped for RETRY_S, not retried per call


def test_a_store_dying_mid_run_is_retried_after_the_pause(redis_server, monkeypatch):
    store = SharedStore(redis_server.url, lock_s=5)
    assert store.publish(KEY, selection(1.0))
    port = redis_server.port
    redis_server.kill()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)
        assert store.get(KEY) is None
    monkeypatch.setattr(shared, "RETRY_S", 0.0)
    store._down_until = 0.0
    redis_server.proc = subprocess.Popen([redis_server.binary, "--port", str(port), "--bind", "127.0.0.1",
                                          "--save", "", "--appendonly", "no", "--dir", str(redis_server.folder)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if store.publish(KEY, selection(2.0)):
            break
        time.sleep(0.1)
    assert store.get(KEY).created == 2.0           # back in use (the restarted server is empty: no persistence)


def test_a_missing_redis_client_is_a_setting_error_naming_kernels_store(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)
    store = SharedStore("redis://:secret@127.0.0.1:1/0", lock_s=5)
    with pytest.raises(SettingError, match=r"KERNELS_STORE.*kernels\[redis\]") as e:
        store.get(KEY)
    assert "secret" not in str(e.value)


@pytest.mark.parametrize("url, ok", [("redis://localhost:6379/0", True), ("rediss://u:p@host", True),
                                     ("unix:///run/redis.sock", True), ("http://host", False),
                                     ("redis://", False), ("redis://host/db", False), ("unix://relative", False)])
def test_the_store_url_is_checked_naming_the_setting_and_hiding_passwords(monkeypatch, url, ok):
    monkeypatch.setenv("KERNELS_STORE", url.replace("u:p@", "u:hunter2@"))
    if ok:
        assert config.store
    else:
        with pytest.raises(SettingError, match="KERNELS_STORE") as e:
            _ = config.store
        assert "hunter2" not in str(e.value)
