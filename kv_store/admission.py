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
- Per collection: each entry written is accounted to its collection (`KVScope.owner`), and a collection
  with its own budget (`KVScope.budget_bytes`) is held to it besides: at ingestion into its own free
  room only, after a miss by evicting its own lower-scored entries, never another collection's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Sequence

from kv_store.backend import Backend
from kv_store.keys import KVScope


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
        self._owned: dict[str, set[str]] = {}  # collection -> keys accounted to it (some maybe evicted since)

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

    def admits(self, key: str, num_bytes: int, why: Admission, is_final: bool = True,
               scope: KVScope = KVScope()) -> bool:
        """Whether an entry of `num_bytes` for `key` should be written now. Counted when final, and
        when not admitted (a caller asking before computing the entry does not compute it)."""
        return self.decide(key, num_bytes, why, is_final, scope) is not None

    def decide(self, key: str, num_bytes: int, why: Admission, is_final: bool = True,
               scope: KVScope = KVScope()) -> list[str] | None:
        """None: not admitted. Else the keys of the scope's collection to evict first, from the tier,
        to keep it within its own budget (empty: it fits)."""
        free = self.max_bytes - self.tier.bytes_used()
        is_admitted = num_bytes <= free
        if not is_admitted and why is Admission.USE and num_bytes <= self.max_bytes:
            victims = list(self._victims(num_bytes - max(free, 0)))
            with self._lock:
                mine = self._score_locked(key)
                is_admitted = bool(victims) and all(self._score_locked(v) < mine for v in victims)
        own_victims: list[str] | None = []
        if is_admitted:
            own_victims = self._owner_room(key, num_bytes, why, scope)
            is_admitted = own_victims is not None
        if is_final or not is_admitted:
            with self._lock:
                self._counts["admitted" if is_admitted else "rejected"] += 1
        return own_victims if is_admitted else None

    def _owner_room(self, key: str, num_bytes: int, why: Admission, scope: KVScope) -> list[str] | None:
        """The collection's own budget: [] when the entry fits its free room; after a miss, its own
        entries to evict (lowest-scored first, each scored below this one); None: not admitted."""
        if scope.owner is None or scope.budget_bytes is None:
            return []
        held = {k: n for k, n in self._held(scope.owner).items() if k != key}
        free = scope.budget_bytes - sum(held.values())
        if num_bytes <= free:
            return []
        if why is not Admission.USE or num_bytes > scope.budget_bytes:
            return None
        with self._lock:
            mine = self._score_locked(key)
            ranked = sorted(held, key=self._score_locked)
            victims, freed = [], 0
            for victim in ranked:
                if freed >= num_bytes - free:
                    break
                if self._score_locked(victim) >= mine:
                    return None
                victims.append(victim)
                freed += held[victim]
        return victims if freed >= num_bytes - free else None

    def note_owner(self, key: str, owner: str | None) -> None:
        """Account `key`'s entry to collection `owner` (a shared entry: to the first that wrote it)."""
        if owner is None:
            return
        with self._lock:
            if not any(key in keys for keys in self._owned.values()):
                self._owned.setdefault(owner, set()).add(key)

    def note_owners(self, owners: dict[str, str]) -> None:
        """`note_owner` for many (at start-up: the entries already in the tier, by their chunks' collections)."""
        for key, owner in owners.items():
            self.note_owner(key, owner)

    def _held(self, owner: str) -> dict[str, int]:
        """The owner's keys the tier still holds, with their bytes; the others are forgotten."""
        with self._lock:
            keys = list(self._owned.get(owner, ()))
        sizes = self.tier.sizes_of(keys) if keys else []
        held = {k: n for k, n in zip(keys, sizes) if n is not None}
        with self._lock:
            if owner in self._owned:
                self._owned[owner] &= set(held) | (self._owned[owner] - set(keys))
        return held

    def owner_bytes(self, owner: str) -> int:
        """Bytes of the tier's entries accounted to collection `owner`."""
        return sum(self._held(owner).values())

    def forget_owner(self, owner: str) -> None:
        with self._lock:
            self._owned.pop(owner, None)

    def stats(self) -> BudgetStats:
        with self._lock:
            counts = dict(self._counts)
            per_token = self._num_bytes_written / self._num_tokens_written if self._num_tokens_written else None
        return BudgetStats(**counts, evictions=self.tier.counters.snapshot(0).evictions, budget_bytes=self.max_bytes,
                           bytes_used=self.tier.bytes_used(), bytes_per_token=per_token)
