"""The shared selection store (KERNELS_STORE=redis://host:port/db): what one machine tunes, the other machines of
its environment read instead of tuning it again.

What travels is the Selection only, as JSON under the same key the local store uses (problem + environment
fingerprint: machines of another GPU, torch, Triton, CUDA or template version never meet). Binaries do not: a
machine that reads a selection whose winner it has not built builds that one choice, with no benchmark. Redis is a
place other users may write, so an entry is data: it is size-bounded, checked against the schema like a disk entry,
and the caller verifies its winner against the reference before first use (kernels.dispatch.selected).

One machine tunes a problem while the others wait: the tuner holds a lock (SET NX with an expiry, renewed by a
heartbeat thread while the tuner lives, so a killed tuner's lock lapses after KERNELS_STORE_LOCK_S) and the others
poll for its published entry for up to KERNELS_STORE_WAIT seconds, then tune themselves.

Every Redis failure (refused, timed out, gone mid-run, an error reply) is caught here: the lookup goes on as if
there were no shared store, with one warning per process, and the store is tried again after RETRY_S. A key of
another redis type under an entry's name (WRONGTYPE) is no failure of the store but one bad entry: a miss, replaced
by the next publish. Nothing in this module raises into a caller but a missing `redis` client, which is a
configuration error (SettingError).
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kernels.core import counters as _stats
from kernels.core.cache_root import warn_once
from kernels.core.config import redact_url
from kernels.core.errors import SettingError
from kernels.core.selection import Selection
from kernels.store.schema import problems

T = TypeVar("T")

KEY_PREFIX = "kernels:selection:"
LOCK_PREFIX = "kernels:tuning:"
MAX_ENTRY_BYTES = 1 << 20       # a Selection is a few KiB; anything near this is not one of ours
CONNECT_TIMEOUT_S = 1.0         # a store that is down must not stall a caller's cold lookup for long
SOCKET_TIMEOUT_S = 5.0
RETRY_S = 30.0                  # after a failure the store is skipped this long, then tried again
POLL_S = 0.2                    # how often a waiting machine looks for the tuner's entry

# publish unless the stored entry is at least as new: a slow machine must not replace a later tune with its older one.
# An entry this process read and found bad (ARGV[3]: its sha1) is replaced whatever its "created" says, if it is still
# the same bytes: else a bad entry claiming a far future would keep every machine from sharing that problem. A value
# of another redis type under the key (a list, a hash: GET's WRONGTYPE error) is no entry at all: SET replaces it
_PUBLISH_IF_NEWER = """
local cur = redis.pcall('GET', KEYS[1])
if type(cur) == 'table' and cur['err'] then
  cur = nil
end
if cur and ARGV[3] ~= '' and redis.sha1hex(cur) == ARGV[3] then
  cur = nil
end
if cur then
  local ok, old = pcall(cjson.decode, cur)
  if ok and type(old) == 'table' and type(old['created']) == 'number' and old['created'] >= tonumber(ARGV[2]) then
    return 0
  end
end
redis.call('SET', KEYS[1], ARGV[1])
return 1
"""


class _WrongType:
    """What `get` read when the key holds another redis type than a string (a list, a hash, a set)."""


WRONG_TYPE = _WrongType()


def _get_entry(r, name: str):
    """GET, with a WRONGTYPE error reply (the key holds a list, a hash, ...) read as WRONG_TYPE: that is one bad
    entry, not a store that is down. The redis client is an optional import, so its error reply is told by the code
    redis puts first in its message."""
    try:
        return r.get(name)
    except Exception as e:  # noqa: BLE001 - anything else is the store failing: re-raised, _call handles it
        if any(c.__name__ == "ResponseError" for c in type(e).__mro__) and str(e).startswith("WRONGTYPE"):
            return WRONG_TYPE
        raise


def _sha1(raw) -> str:
    """What redis.sha1hex gives for the stored value."""
    return hashlib.sha1(raw if isinstance(raw, bytes) else str(raw).encode()).hexdigest()


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:40]


class SharedStore:
    """One Redis server's selections. Thread-safe (the redis client pools connections)."""

    def __init__(self, url: str, lock_s: float):
        self.url = url
        self.shown = redact_url(url)
        self.lock_s = lock_s
        self._client = None
        self._down_until = 0.0
        self._publish_script = None
        self._bad: dict[str, str] = {}      # key -> sha1 of the bad entry `get` found there (publish replaces it)

    # -- the client and its failures -------------------------------------------------------------------------------
    def _redis(self):
        """The client, made on first use; None while the store is marked down."""
        if time.monotonic() < self._down_until:
            return None
        if self._client is None:
            try:
                import redis
            except ImportError as e:
                raise SettingError(f"KERNELS_STORE={self.shown!r} needs the redis client: pip install "
                                   "'kernels[redis]' (or unset KERNELS_STORE)") from e
            self._client = redis.Redis.from_url(self.url, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                                socket_timeout=SOCKET_TIMEOUT_S, health_check_interval=30)
        return self._client

    def _failed(self, what: str, error: Exception) -> None:
        _stats.bump("store_errors")
        self._down_until = time.monotonic() + RETRY_S
        warn_once(f"shared store {self.url}",
                  f"kernels: the shared store {self.shown} failed ({what}: {type(error).__name__}: {error}); tuning "
                  f"locally (tried again after {RETRY_S:.0f} s; this warning is not repeated)", stacklevel=4)

    def _call(self, what: str, fn: Callable, default=None):
        """fn(client), or `default` when the store is down or fails (marked down, warned about once)."""
        client = self._redis()
        if client is None:
            return default
        try:
            return fn(client)
        except Exception as e:  # noqa: BLE001 - any failure of the store degrades to local tuning
            self._failed(what, e)
            return default

    # -- entries ---------------------------------------------------------------------------------------------------
    def get(self, key: str) -> Selection | None:
        """The published selection for exactly this key, or None (absent, malformed, another key, store down)."""
        raw = self._call("read", lambda r: _get_entry(r, KEY_PREFIX + _digest(key)))
        if raw is None:
            return None
        why = None
        try:
            if raw is WRONG_TYPE:
                raise TypeError("the key holds another redis type than a string")
            if len(raw) > MAX_ENTRY_BYTES:
                raise ValueError(f"{len(raw)} bytes")
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("key") != key:
                self._bad[key] = _sha1(raw)      # under our prefix, not our entry: a miss, and publish replaces it
                return None
            why = problems(data.get("selection"))
            # publish compares the outer "created": one that is not the selection's would decide for it
            if why is None and data.get("created") != data["selection"].get("created"):
                why = f"created {data.get('created')!r} is not the selection's"
            if why is None:
                return Selection.from_dict(data["selection"], source="shared")
        except (AttributeError, KeyError, TypeError, ValueError, UnicodeDecodeError, RecursionError) as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
        self._bad[key] = "" if raw is WRONG_TYPE else _sha1(raw)      # publish's script replaces another type anyway
        warn_once(f"bad shared entry {key}", f"kernels: ignoring a bad entry in the shared store {self.shown} "
                  f"({why}); the problem is tuned here and the entry replaced", stacklevel=3)
        return None

    def publish(self, key: str, selection: Selection) -> bool:
        """Put the selection unless the store holds one at least as new. True when this one is there now."""
        body = json.dumps({"key": key, "created": selection.created, "selection": selection.to_dict()},
                          sort_keys=True)

        def put(r) -> bool:
            if self._publish_script is None:
                self._publish_script = r.register_script(_PUBLISH_IF_NEWER)
            return bool(self._publish_script(keys=[KEY_PREFIX + _digest(key)],
                                             args=[body, repr(selection.created), self._bad.get(key, "")]))

        written = self._call("publish", put, default=False)
        if written:
            self._bad.pop(key, None)
            _stats.bump("store_publishes")
        return written

    # -- tune once across machines ---------------------------------------------------------------------------------
    def tune_once(self, key: str, load: Callable[[], T | None], build: Callable[[], T], wait_s: float) -> T:
        """load() -> claim the key's tuning lock -> build() (which publishes); while another machine holds the lock,
        load() again every POLL_S for up to `wait_s`, then build() here. `load` reads the shared entry and readies
        its winner; a store that is down builds at once."""
        deadline = time.monotonic() + wait_s
        waited = False
        lock_key = LOCK_PREFIX + _digest(key)
        while True:
            found = load()
            if found is not None:
                return found
            lock = self._call("lock", lambda r: r.lock(lock_key, timeout=self.lock_s, thread_local=False))
            claimed = None if lock is None else self._call("lock", lambda r: lock.acquire(blocking=False))
            if claimed is None:                     # the store is down: build here
                return build()
            if claimed:
                return self._build_holding(lock, build)
            if not waited and self._call("lock", lambda r: _drop_if_not_a_lock(r, lock_key)):
                continue                            # something else sat at the lock's key: gone, claim it now
            if time.monotonic() >= deadline:
                if wait_s > 0:
                    warn_once("waited for the shared store", f"kernels: waited {wait_s:g} s for another machine's tune of a "
                              "problem (KERNELS_STORE_WAIT); tuning it here too (this warning is not repeated)", stacklevel=3)
                return build()
            if not waited:
                waited = True
                _stats.bump("store_waits")
            time.sleep(POLL_S)

    def _build_holding(self, lock, build: Callable[[], T]) -> T:
        beat = _Heartbeat(lock, self.lock_s / 3)
        beat.start()
        try:
            return build()
        finally:
            beat.stop()
            try:
                lock.release()
            except Exception:  # noqa: BLE001 - lapsed (a stall past its lifetime) or the store is gone: no harm
                pass


def _drop_if_not_a_lock(client, lock_key: str) -> bool:
    """Delete what sits at a tuning lock's key when it is not a lock (a lock is a string with an expiry): a list or a
    hash there never lapses, so every machine would wait KERNELS_STORE_WAIT on the problem, forever. True if it went."""
    kind = client.type(lock_key)
    kind = kind.decode() if isinstance(kind, bytes) else str(kind)
    if kind in ("string", "none") and (kind == "none" or client.pttl(lock_key) > 0):
        return False
    client.delete(lock_key)
    return True


class _Heartbeat(threading.Thread):
    """Renews a held lock's lifetime while the tune runs, so the lifetime can be short: it only has to cover the
    time between a tuner's death and the others noticing."""

    def __init__(self, lock, every_s: float):
        super().__init__(name="kernels-store-heartbeat", daemon=True)
        self._lock, self._every_s = lock, every_s
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.wait(self._every_s):
            try:
                self._lock.reacquire()
            except Exception:  # noqa: BLE001 - lost or store down: the others may tune it too, which is harmless
                return

    def stop(self) -> None:
        self._stopped.set()
        self.join(timeout=1.0)


_stores: dict[tuple[str, float], SharedStore] = {}
_stores_lock = threading.Lock()


def store_for(url: str, lock_s: float) -> SharedStore | None:
    """The process's SharedStore for this URL ('' -> None): one client and one down-mark per server."""
    if not url:
        return None
    with _stores_lock:
        store = _stores.get((url, lock_s))
        if store is None:
            store = _stores[(url, lock_s)] = SharedStore(url, lock_s)
        return store
