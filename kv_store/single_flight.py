"""Single-flight chunk precompute across replicas: when several server processes need the same chunk's
KV at once (the same document ingested through two replicas, a background backfill or repair both
schedule), one computes it under a Redis lock (SET NX PX: it expires if its holder dies) and the
others wait for the entry to appear in the shared tier (ingest) or skip it (background work).

Without Redis there is nothing to share: every precompute runs (one process, one engine worker).
A Redis failure is treated as holding the lock: the entry is a cache, computing it twice is safe."""

from __future__ import annotations

import logging
import secrets
import time
from enum import Enum
from typing import Callable, TYPE_CHECKING

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kv_store.admission import Admission
from kv_store.keys import KVScope

if TYPE_CHECKING:
    from blend_engine.kv import ChunkKV
    from kv_store.store import KVStore

logger = logging.getLogger(__name__)
LOCK_PREFIX = "ragblend:lock:kv:"
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) else return 0 end"


class PrecomputeReason(str, Enum):
    INGEST = "ingest"
    BACKFILL = "backfill"
    REPAIR = "repair"


class PrecomputeOutcome(str, Enum):
    COMPUTED = "computed"  # by this process
    FOUND = "found"  # another replica computed it (waited for, or already there under the lock)
    SKIPPED = "skipped"  # another replica is computing it and the caller does not wait (background)
    NOT_ADMITTED = "not_admitted"  # computed here, but the collection's KV budget kept hotter entries


class PrecomputeLocks:
    """The lock, or a no-op when no Redis is configured (`url` None)."""

    def __init__(self, url: str | None, ttl_s: float, timeout_s: float = 2.0):
        self.ttl_s = ttl_s
        self._client = None if url is None else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 1.0), retry=Retry(NoBackoff(), 1)
        )

    @property
    def is_shared(self) -> bool:
        return self._client is not None

    def acquire(self, key: str) -> str | None:
        """A token when this process holds the lock now, None when another does."""
        token = secrets.token_hex(8)
        if self._client is None:
            return token
        try:
            is_set = self._client.set(LOCK_PREFIX + key, token, nx=True, px=int(self.ttl_s * 1000))
        except redis.RedisError as exc:
            logger.warning("redis lock failed (%s): computing KV %s without it", exc, key[:16])
            return token
        return token if is_set else None

    def release(self, key: str, token: str) -> None:
        if self._client is None:
            return
        try:  # only our own lock: an expired one may be someone else's by now
            self._client.eval(_RELEASE, 1, LOCK_PREFIX + key, token)
        except redis.RedisError as exc:
            logger.warning("redis unlock failed (%s): the lock on %s expires by itself", exc, key[:16])

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


class SingleFlight:
    """`ensure(key, compute, reason)`: the entry exists afterwards (computed here or by another replica),
    unless another replica holds the lock and the reason is background work (SKIPPED)."""

    def __init__(self, kv_store: KVStore, locks: PrecomputeLocks,
                 on_outcome: Callable[[PrecomputeReason, PrecomputeOutcome], None] | None = None,
                 max_poll_s: float = 0.25):
        self._kv_store, self._locks, self._on_outcome, self._max_poll_s = kv_store, locks, on_outcome, max_poll_s

    def ensure(self, key: str, compute: Callable[[], ChunkKV], reason: PrecomputeReason,
               admission: Admission | None = None, scope: KVScope = KVScope()) -> PrecomputeOutcome:
        """`admission`: the entry is offered to the KV budget for this reason (written only if
        admitted); None: written unconditionally. `scope`: the chunk's collection (its key's salt, its
        own budget)."""
        outcome = self._ensure(key, compute, is_waiting=reason is PrecomputeReason.INGEST, admission=admission,
                               scope=scope)
        if self._on_outcome is not None:
            self._on_outcome(reason, outcome)
        return outcome

    def _ensure(self, key: str, compute: Callable[[], ChunkKV], is_waiting: bool,
                admission: Admission | None, scope: KVScope) -> PrecomputeOutcome:
        token = self._locks.acquire(key)
        if token is None:
            if not is_waiting:
                return PrecomputeOutcome.SKIPPED
            token = self._wait(key)
            if token is None:
                return PrecomputeOutcome.FOUND
        try:
            if self._locks.is_shared and self._kv_store.readable_many([key])[0]:
                return PrecomputeOutcome.FOUND  # computed by another replica just before we took the lock
            if admission is None:
                self._kv_store.put(key, compute(), scope.salt)
                return PrecomputeOutcome.COMPUTED
            is_written = self._kv_store.offer(key, compute(), admission, scope)
            return PrecomputeOutcome.COMPUTED if is_written else PrecomputeOutcome.NOT_ADMITTED
        finally:
            self._locks.release(key, token)

    def _wait(self, key: str) -> str | None:
        """Wait for the holder's entry (None) or for the lock, freed or expired without one (a token).
        Past the lock's expiry, compute anyway (returns a token) rather than wait forever."""
        deadline, poll_s = time.monotonic() + self._locks.ttl_s, 0.02
        while time.monotonic() < deadline:
            time.sleep(poll_s)
            poll_s = min(poll_s * 2, self._max_poll_s)
            if self._kv_store.readable_many([key])[0]:
                return None
            token = self._locks.acquire(key)
            if token is not None:
                return token
        logger.warning("KV %s: its lock outlived %.0f s; computing it here", key[:16], self._locks.ttl_s)
        return secrets.token_hex(8)
