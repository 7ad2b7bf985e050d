"""KV of large documents, computed between questions: a document over `retrieval.max_inline_kv_chars` is
committed at once (its text is searchable and answerable right away, recomputed per question) and its
chunks' KV is precomputed afterwards, one chunk per low-priority unit of the engine loop. A question that arrives
meanwhile waits for at most one chunk's precompute, never for the whole document; `kv_cached` in
`GET /v1/documents/{id}` fills in as it goes."""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence, TYPE_CHECKING

from kv_store.admission import Admission
from kv_store.keys import KVScope
from kv_store.single_flight import PrecomputeLocks, PrecomputeReason, SingleFlight
from retrieval.store_types import StoredChunk
from runtime.loop import EngineLoop

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine
    from kv_store import KVStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackfillStats:
    num_pending: int
    num_done: int  # chunks whose KV was computed (or found present, or whose chunk is gone)
    num_failed: int


class KVBackfill:
    def __init__(self, engine: BlendEngine, kv_store: KVStore, loop: EngineLoop, is_live: Callable[[str], bool],
                 context_ids: Sequence[int], single_flight: SingleFlight | None = None):
        """`is_live(key)`: whether a stored chunk still points at the key (a replaced document's
        chunks are skipped). `context_ids`: the attention sink chunks are precomputed behind.
        `single_flight`: a chunk another replica is computing is skipped, not computed twice."""
        self._engine, self._kv_store, self._loop, self._is_live = engine, kv_store, loop, is_live
        self._flight = single_flight or SingleFlight(kv_store, PrecomputeLocks(None, 1.0))
        self._context_ids = tuple(context_ids)
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, tuple[int, ...], KVScope]] = deque()  # (key, token ids, scope), oldest first
        self._is_scheduled = False  # one task in the loop's background queue at a time
        self._num_done = self._num_failed = 0

    def schedule(self, chunks: Sequence[StoredChunk], scope: KVScope = KVScope()) -> None:
        """Queue these chunks' KV (`scope`: their collection's KV namespace and budget)."""
        with self._lock:
            self._queue.extend((c.kv_key, tuple(c.token_ids), scope) for c in chunks if c.kv_key)
        self._submit_next()

    def _submit_next(self) -> None:
        with self._lock:
            if self._is_scheduled or not self._queue:
                return
            self._is_scheduled = True
        if not self._loop.submit_background(self._step):  # full or closing: the next schedule retries
            with self._lock:
                self._is_scheduled = False

    def _step(self) -> None:
        """One chunk (on the engine loop, as a background unit), then queue the next."""
        with self._lock:
            key, token_ids, scope = self._queue.popleft()
        try:
            if (self._is_live(key) and not self._kv_store.readable_many([key])[0]  # budget: free room only
                    and self._kv_store.should_compute(key, len(token_ids), Admission.PRECOMPUTE, scope)):
                self._flight.ensure(key, lambda: self._engine.precompute(list(token_ids), self._context_ids),
                                    PrecomputeReason.BACKFILL, Admission.PRECOMPUTE, scope)
            self._count(is_failed=False)
        except Exception:
            logger.exception("precomputing KV %s in the background failed", key[:16])
            self._count(is_failed=True)
        finally:
            with self._lock:
                self._is_scheduled = False
            self._submit_next()

    def _count(self, is_failed: bool) -> None:
        with self._lock:
            if is_failed:
                self._num_failed += 1
            else:
                self._num_done += 1

    def stats(self) -> BackfillStats:
        with self._lock:
            return BackfillStats(len(self._queue), self._num_done, self._num_failed)
