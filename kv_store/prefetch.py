"""Background copy-up of chunk KV into the memory tier, started as soon as a request's chunks are known.

One thread (loads are I/O; more would only compete with the engine for cores), a bound on the bytes
in flight (a burst of requests cannot pile up gigabytes of reads), and a key is never queued twice.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

log = logging.getLogger(__name__)


class Prefetcher:
    def __init__(self, read_through: Callable[[str], object], max_bytes: int):
        self._read_through, self.max_bytes = read_through, max_bytes
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # key -> bytes in flight
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-prefetch")

    def submit(self, key: str, num_bytes: int) -> bool:
        """Queue `key` unless it is queued already or would exceed the byte bound."""
        with self._lock:
            if key in self._pending or sum(self._pending.values()) + num_bytes > self.max_bytes:
                return False
            self._pending[key] = num_bytes
        self._pool.submit(self._run, key)
        return True

    def _run(self, key: str) -> None:
        try:
            self._read_through(key)  # a read through the tiers copies the entry up
        except Exception:  # a prefetch is an optimisation: the request reads the entry itself
            log.exception("prefetch of %s failed", key[:16])
        finally:
            with self._lock:
                self._pending.pop(key, None)

    def wait(self) -> None:
        """Block until everything queued so far is done (tests, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
