"""The collection's KV budget: which chunks keep their KV in the bounded tier when the collection's KV
does not fit (RAGCache's idea: keep the KV of the chunks retrieved most; TinyLFU's admission rule).

- Every use of a chunk (a question's `handle`) adds 1 to its score, which halves every
  `half_life_uses` uses of the whole store: frequency and recency in one number.
- At ingestion (`Admission.PRECOMPUTE`) an entry is written only into free room: precomputing never
  evicts an entry that earned its place.
- After a miss (`Admission.USE`: computed on first use, in the background), the entry is admitted
  when it fits the free room, or when its score beats every entry it would evict (the bounded tier's
  least recently used ones); otherwise it is not cached, and its next questions compute its tokens
  fresh (the loading planner plans around missing KV), until it has earned a place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

from kv_store.backend import Backend


class Admission(str, Enum):
    """Why an entry is offered to the store."""

    PRECOMPUTE = "precompute"  # ingestion: free room only
    USE = "use"  # computed after a question missed it: admitted when it earns the place


@dataclass(frozen=True)
class BudgetStats:
    hits: int = 0  # chunk uses whose KV some tier held
    misses: int = 0  # chunk uses with no KV anywhere (computed fresh in the prompt)
    admitted: int = 0  # entries written under the budget (precomputed or earned)
    rejected: int = 0  # entries not written: no room at ingestion, or not yet earned after a miss
    evictions: int = 0  # entries the bounded tier dropped to make room
    budget_bytes: int = 0  # the bounded tier's bound
    bytes_used: int = 0
    bytes_per_token: float | None = None  # measured mean of the entries written (None before any)


class AdmissionPolicy:
    """Thread-safe scores of chunk keys and the admission rule over one bounded tier."""

    def __init__(self, tier: Backend, max_bytes: int, half_life_uses: int = 10_000, max_tracked: int = 1_000_000,
                 victims: Callable[[int], Sequence[str]] | None = None):
        """`victims(num_bytes)`: the keys the tier would evict, in order, to free `num_bytes`."""
        if half_life_uses < 1 or max_tracked < 1:
            raise ValueError("half_life_uses and max_tracked must be >= 1")
        self.tier, self.max_bytes = tier, max_bytes
        self._half_life, self._max_tracked = float(half_life_uses), max_tracked
        self._victims = victims or (lambda num_bytes: ())
        self._lock = threading.Lock()
        self._clock = 0  # uses so far
        self._scores: dict[str, tuple[float, int]] = {}  # key -> (score at its last use, clock then)
        self._counts = dict.fromkeys(("hits", "misses", "admitted", "rejected"), 0)
        self._num_tokens_written = 0
        self._num_bytes_written = 0

    def note_uses(self, keys: Sequence[str], is_hit: Sequence[bool]) -> None:
        with self._lock:
            for key, hit in zip(keys, is_hit):
                self._clock += 1
                self._scores[key] = (self._score_locked(key) + 1.0, self._clock)
                self._counts["hits" if hit else "misses"] += 1
            if len(self._scores) > self._max_tracked:
                self._prune_locked()

    def score(self, key: str) -> float:
        with self._lock:
            return self._score_locked(key)

    def _score_locked(self, key: str) -> float:
        score, at = self._scores.get(key, (0.0, self._clock))
        return score * 0.5 ** ((self._clock - at) / self._half_life)

    def _prune_locked(self) -> None:
        """Forget the lower-scored half: bounded memory for a collection of any size."""
        ranked = sorted(self._scores, key=self._score_locked)
        for key in ranked[: len(ranked) // 2]:
            del self._scores[key]

    def estimated_bytes(self, num_tokens: int) -> int | None:
        """An entry's bytes, from the mean of those written (None before the first)."""
        with self._lock:
            if self._num_tokens_written == 0:
                return None
            return int(num_tokens * self._num_bytes_written / self._num_tokens_written) + 1

    def observe_written(self, num_tokens: int, num_bytes: int) -> None:
        with self._lock:
            self._num_tokens_written += num_tokens
            self._num_bytes_written += num_bytes

    def admits(self, key: str, num_bytes: int, why: Admission, is_final: bool = True) -> bool:
        """Whether an entry of `num_bytes` for `key` should be written now. Counted when final, and
        when not admitted (a caller asking before computing the entry does not compute it)."""
        free = self.max_bytes - self.tier.bytes_used()
        is_admitted = num_bytes <= free
        if not is_admitted and why is Admission.USE and num_bytes <= self.max_bytes:
            victims = list(self._victims(num_bytes - max(free, 0)))
            with self._lock:
                mine = self._score_locked(key)
                is_admitted = bool(victims) and all(self._score_locked(v) < mine for v in victims)
        if is_final or not is_admitted:
            with self._lock:
                self._counts["admitted" if is_admitted else "rejected"] += 1
        return is_admitted

    def stats(self) -> BudgetStats:
        with self._lock:
            counts = dict(self._counts)
            per_token = self._num_bytes_written / self._num_tokens_written if self._num_tokens_written else None
        return BudgetStats(**counts, evictions=self.tier.counters.snapshot(0).evictions, budget_bytes=self.max_bytes,
                           bytes_used=self.tier.bytes_used(), bytes_per_token=per_token)
