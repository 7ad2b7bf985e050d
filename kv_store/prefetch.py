"""Background copy-up of chunk KV into the memory tier, started as soon as a request's chunks are known.

One thread (loads are I/O; more would only compete with the engine for cores), a bound on the bytes
in flight (a burst of requests cannot pile up gigabytes of reads), and a key is never queued twice.
An entry in flight is shared: the request's `handle` reads through it, so a layer the prefetch has
read is not read again, and one it has not yet read is read once, by whichever thread gets there first.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from blend_engine.threads import lower_to_idle_priority, pin_one_thread
from kv_store.entry import OpenEntry

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, copy_up: Callable[[OpenEntry], object], max_bytes: int, is_idle: bool = False):
        self._copy_up, self.max_bytes = copy_up, max_bytes
        self._lock = threading.Lock()
        self._pending: dict[str, OpenEntry] = {}  # key -> its entry, in flight
        # its copies run torch: on one thread of its own, never an OpenMP pool beside the engine's;
        # `is_idle`: at idle priority, behind the engine's threads (store.loader_priority, decision 0017)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch",
                                        initializer=_idle_thread if is_idle else pin_one_thread)

    def submit(self, entry: OpenEntry) -> bool:
        """Queue `entry` unless its key is queued already or it would exceed the byte bound."""
        with self._lock:
            in_flight = sum(e.num_bytes for e in self._pending.values())
            if entry.key in self._pending or in_flight + entry.num_bytes > self.max_bytes:
                return False
            self._pending[entry.key] = entry
        self._pool.submit(self._run, entry)
        return True

    def entry(self, key: str) -> OpenEntry | None:
        """The entry of `key` if it is in flight (its layers shared with the caller), else None."""
        with self._lock:
            return self._pending.get(key)

    def _run(self, entry: OpenEntry) -> None:
        try:
            self._copy_up(entry)
        except Exception:  # a prefetch is an optimisation: the request reads the entry itself
            log.exception("prefetch of %s failed", entry.key[:16])
        finally:
            with self._lock:
                self._pending.pop(entry.key, None)

    def wait(self) -> None:
        """Block until everything queued so far is done (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            self._pending.clear()  # cancelled ones: their readers close when collected


def _idle_thread() -> None:
    pin_one_thread()
    if not lower_to_idle_priority():
        log.debug("the prefetch thread keeps the server's CPU priority: this platform has no SCHED_IDLE for it")
