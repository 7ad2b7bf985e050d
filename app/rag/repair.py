"""Self-healing KV, and KV computed on first use: a chunk whose entry a question found missing
(damaged, evicted, or never precomputed: the collection's KV budget was full at ingestion) is
computed in the background, as a low-priority task of the engine loop (never beside the engine's
own forward, never ahead of a request), and cached when the budget admits it (kv_store/admission.py:
it has been used more than what it would evict), so the next question reuses it."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence, TYPE_CHECKING

from kv_store.admission import Admission
from kv_store.keys import KVScope
from kv_store.single_flight import PrecomputeLocks, PrecomputeOutcome, PrecomputeReason, SingleFlight
from runtime.loop import EngineLoop

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine
    from kv_store import KVStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RepairStats:
    num_scheduled: int = 0
    num_repaired: int = 0
    num_skipped: int = 0  # healed meanwhile, or the chunk is gone
    num_not_admitted: int = 0  # the budget keeps hotter chunks' KV: not computed (yet)
    num_failed: int = 0
    num_dropped: int = 0  # the background queue was full: retried at the next miss
    num_elsewhere: int = 0  # another replica was repairing it (its lock held): not done twice
    num_pending: int = 0  # queued or running now: each may still write an entry


class KVRepairer:
    def __init__(self, engine: BlendEngine, kv_store: KVStore, loop: EngineLoop,
                 scope_of: Callable[[str], KVScope | None],
                 single_flight: SingleFlight | None = None):
        """`scope_of(key)`: the KV namespace of a collection whose chunk still points at the key (its
        salt, to check the key; its budget), None when no chunk does (checked when the task runs).
        `single_flight`: a chunk another replica is repairing is left to it."""
        self._engine, self._kv_store, self._loop, self._scope_of = engine, kv_store, loop, scope_of
        self._flight = single_flight or SingleFlight(kv_store, PrecomputeLocks(None, 1.0))
        self._lock = threading.Lock()
        self._pending: set[str] = set()
        self._counts = dict.fromkeys(RepairStats.__dataclass_fields__.keys() - {"num_pending"}, 0)

    def schedule(self, key: str, token_ids: Sequence[int], context_ids: Sequence[int]) -> bool:
        """Queue a repair of `key` (any thread; returns at once). False when already queued or full."""
        with self._lock:
            if key in self._pending:
                return False
            self._pending.add(key)
        task = lambda: self._repair(key, tuple(token_ids), tuple(context_ids))  # noqa: E731
        if not self._loop.submit_background(task):
            with self._lock:
                self._pending.discard(key)
            self._count("num_dropped")
            return False
        self._count("num_scheduled")
        return True

    def _repair(self, key: str, token_ids: tuple[int, ...], context_ids: tuple[int, ...]) -> None:
        try:
            scope = self._scope_of(key)
            if scope is None or self._kv_store.readable_many([key])[0]:
                self._count("num_skipped")
                return
            if key != self._kv_store.key_for(token_ids, context_ids, scope.salt):  # the config changed since ingest
                logger.warning("KV %s: not this chunk's key under the current config; not repaired", key[:16])
                self._count("num_skipped")
                return
            if not self._kv_store.should_compute(key, len(token_ids), Admission.USE, scope):
                self._count("num_not_admitted")
                return
            outcome = self._flight.ensure(key, lambda: self._engine.precompute(list(token_ids), context_ids),
                                          PrecomputeReason.REPAIR, Admission.USE, scope)
            self._count({PrecomputeOutcome.COMPUTED: "num_repaired", PrecomputeOutcome.FOUND: "num_skipped",
                         PrecomputeOutcome.SKIPPED: "num_elsewhere",
                         PrecomputeOutcome.NOT_ADMITTED: "num_not_admitted"}[outcome])
        except Exception:
            logger.exception("repairing KV %s failed", key[:16])
            self._count("num_failed")
        finally:
            with self._lock:
                self._pending.discard(key)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def stats(self) -> RepairStats:
        with self._lock:
            return RepairStats(**self._counts, num_pending=len(self._pending))
