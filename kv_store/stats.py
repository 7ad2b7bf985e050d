"""Store statistics: thread-safe per-tier counters and the frozen snapshots the server exports."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0  # entries found damaged or mismatched, deleted and counted as misses
    errors: int = 0  # backend failures (e.g. Redis unreachable), counted as misses
    bytes_used: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    load_seconds: float = 0.0  # time spent reading + verifying + decoding entries

    @property
    def load_throughput(self) -> float | None:
        """Measured bytes/s of loads, or None before any."""
        return self.bytes_read / self.load_seconds if self.load_seconds > 0 else None


@dataclass(frozen=True)
class StoreStats:
    tiers: dict[str, TierStats]
    num_recovered: int = 0  # entries damaged or lost mid-request, recomputed inline and put back
    budget: object | None = None  # kv_store.admission.BudgetStats: the collection's KV budget
    prefix: object | None = None  # kv_store.prefix_cache.PrefixCacheStats: the prefix cache


class TierCounters:
    """Mutable counters of one tier; every update takes the lock (threads load concurrently)."""

    _FIELDS = ("hits", "misses", "evictions", "corrupt", "errors", "bytes_read", "bytes_written", "load_seconds")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(self._FIELDS, 0)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                if name not in self._values:
                    raise KeyError(f"unknown counter {name!r}")
                self._values[name] += delta

    def snapshot(self, bytes_used: int) -> TierStats:
        with self._lock:
            v = dict(self._values)
        ints = {name: int(v[name]) for name in self._FIELDS if name != "load_seconds"}
        return TierStats(**ints, load_seconds=float(v["load_seconds"]), bytes_used=bytes_used)
