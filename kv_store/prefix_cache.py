"""The prefix cache: finished prompts' KV kept across requests, found by the longest prefix of token ids.

A prompt seen before costs almost nothing: after a request's prefill its whole prompt KV stays here
(the executor keeps it: runtime/executor.py), keyed by its token ids in a radix tree (a trie whose
edges hold runs of token ids), and a later prompt reuses the longest prefix it shares with any kept
one, exactly, computing only the rest. The tree holds no tensors itself: each entry carries the
caller's value (the runtime's kept prompt) and its size.

- **Apart what must stay apart**: every lookup and insert names a `namespace` (a request's isolation
  key, e.g. a collection's KV salt) and a `kind` (which requests may reuse the entry: one computed
  exactly serves every request, an approximate one only requests asking for the same blend); each
  (namespace, kind) is a tree of its own.
- **Bounded**: the entries' bytes stay within `max_bytes` (`store.prefix_cache_bytes`), evicting the
  least recently used; an entry larger than the bound is not kept.
- **Invalidated** by chunk: each entry lists the stored chunks its prompt holds (their KV keys), and a
  changed or deleted document drops every entry holding one of its chunks (`invalidate_chunks`, or
  `retain_live` where only the live keys are known: a replica following another's writes). A prompt
  prefilled before such a change and kept after it is refused (`insert`'s `epoch`: the cache's
  `epoch` when its prefill began).
- Thread-safe: the engine loop looks up and inserts, the writers and the index follower invalidate,
  the metrics read the counters.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Callable, Generic, Iterable, Sequence, TypeVar

V = TypeVar("V")
MAX_INVALIDATED_KEYS = 100_000  # chunk keys remembered as invalidated (for prompts still prefilling)


@dataclass(eq=False)
class CachedPrompt(Generic[V]):
    """One kept prompt: its token ids, the caller's value, its bytes and the chunk keys it holds."""

    token_ids: tuple[int, ...]
    value: V
    nbytes: int
    chunk_keys: frozenset[str]
    namespace: str
    kind: str
    last_used: int = 0  # the cache's clock at its last insert or use (LRU)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PrefixMatch(Generic[V]):
    """The longest kept prefix of a prompt: `num_tokens` of its tokens are `entry`'s first ones."""

    entry: CachedPrompt[V]
    num_tokens: int
    num_prompt_tokens: int

    @property
    def is_whole(self) -> bool:
        """The prompt is exactly the entry's: its KV and logits serve the prompt as they are."""
        return self.num_tokens == self.num_prompt_tokens == self.entry.num_tokens


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int = 0  # lookups whose whole prompt was kept (nothing computed)
    partial_hits: int = 0  # lookups that reused a kept prefix and computed the rest
    misses: int = 0  # lookups that reused nothing (no match, or the planner preferred another plan)
    tokens_served: int = 0  # prompt tokens served from kept prefixes
    insertions: int = 0
    evictions: int = 0  # entries dropped for room (LRU)
    invalidations: int = 0  # entries dropped because a document they hold changed or was deleted
    num_entries: int = 0
    bytes_used: int = 0
    max_bytes: int = 0


@dataclass(eq=False)
class _Node(Generic[V]):
    label: tuple[int, ...]  # the token ids on the edge from its parent
    children: dict[int, _Node[V]] = field(default_factory=dict)  # by the first token of their label
    entries: set[CachedPrompt[V]] = field(default_factory=set)  # every entry whose prompt passes here
    terminal: CachedPrompt[V] | None = None  # the entry whose prompt ends here


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the common prefix of `a` and `b`."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)


class PrefixCache(Generic[V]):
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._roots: dict[tuple[str, str], _Node[V]] = {}
        self._entries: set[CachedPrompt[V]] = set()
        self._clock = itertools.count(1)
        self._bytes = 0
        self._epoch = 0  # invalidations so far
        self._invalidated_at: dict[str, int] = {}  # chunk key -> the epoch of its last invalidation
        self._counts = dict.fromkeys(("hits", "partial_hits", "misses", "tokens_served", "insertions", "evictions",
                                      "invalidations"), 0)

    @property
    def is_enabled(self) -> bool:
        return self.max_bytes > 0

    # --- lookup -------------------------------------------------------------------------------------
    def lookup(self, namespace: str, kinds: Sequence[str], token_ids: Sequence[int]) -> PrefixMatch[V] | None:
        """The longest prefix of `token_ids` kept in `namespace` under one of `kinds` (a whole match
        first, then the longest, then the earlier kind); None when no token matches. The entry counts
        as used (LRU); what the caller then does with it is counted by `record`."""
        token_ids = tuple(token_ids)
        with self._lock:
            best: PrefixMatch[V] | None = None
            for kind in kinds:
                root = self._roots.get((namespace, kind))
                match = self._longest(root, token_ids) if root is not None else None
                if match is not None and (best is None or (match.is_whole, match.num_tokens)
                                          > (best.is_whole, best.num_tokens)):
                    best = match
            if best is not None:
                best.entry.last_used = next(self._clock)
            return best

    def _longest(self, root: _Node[V], token_ids: tuple[int, ...]) -> PrefixMatch[V] | None:
        node, pos, num_tokens = root, 0, len(token_ids)
        while pos < num_tokens:
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            matched = _common_length(child.label, token_ids[pos:pos + len(child.label)])
            pos += matched
            node = child  # every entry under it shares the `pos` tokens matched so far
            if matched < len(child.label):
                break
        if pos == 0:
            return None
        entry = node.terminal if pos == num_tokens and node.terminal is not None else \
            max(node.entries, key=lambda e: e.last_used)
        return PrefixMatch(entry, pos, num_tokens)

    def record(self, match: PrefixMatch[V] | None, num_tokens: int = 0) -> None:
        """What a lookup served: `num_tokens` of `match` reused (0 or None: a miss)."""
        with self._lock:
            if match is None or num_tokens == 0:
                self._counts["misses"] += 1
                return
            self._counts["hits" if match.is_whole and num_tokens == match.num_tokens else "partial_hits"] += 1
            self._counts["tokens_served"] += num_tokens

    # --- insert and evict ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """Invalidations so far: give it to `insert` for a prompt whose prefill begins now."""
        with self._lock:
            return self._epoch

    def insert(self, namespace: str, kind: str, token_ids: Sequence[int], value: V, nbytes: int,
               chunk_keys: Iterable[str] = (), epoch: int | None = None) -> bool:
        """Keep `value` for this prompt (replacing one kept for the same tokens, namespace and kind),
        evicting the least recently used entries for room. False where it cannot fit at all, or where
        one of its chunks was invalidated after `epoch` (its document changed while it was prefilled)."""
        token_ids = tuple(token_ids)
        if not token_ids:
            raise ValueError("cannot keep an empty prompt")
        if nbytes > self.max_bytes:
            return False
        entry = CachedPrompt(token_ids, value, nbytes, frozenset(chunk_keys), namespace, kind)
        with self._lock:
            if epoch is not None and any(self._invalidated_at.get(key, -1) > epoch for key in entry.chunk_keys):
                return False
            root = self._roots.get((namespace, kind))
            kept = self._find(root, token_ids) if root is not None else None
            if kept is not None and kept.terminal is not None:
                self._remove(kept.terminal)
            while self._bytes + nbytes > self.max_bytes:
                self._remove(min(self._entries, key=lambda e: e.last_used))
                self._counts["evictions"] += 1
            root = self._roots.setdefault((namespace, kind), _Node(()))  # removals may have pruned it
            node = self._node_for(root, token_ids)
            entry.last_used = next(self._clock)
            for passed in self._path(root, token_ids):
                passed.entries.add(entry)
            node.terminal = entry
            self._entries.add(entry)
            self._bytes += nbytes
            self._counts["insertions"] += 1
            return True

    def _find(self, root: _Node[V], token_ids: tuple[int, ...]) -> _Node[V] | None:
        """The node where `token_ids` ends exactly, None where the tree has none."""
        node, pos = root, 0
        while pos < len(token_ids):
            node = node.children.get(token_ids[pos])
            if node is None or token_ids[pos:pos + len(node.label)] != node.label:
                return None
            pos += len(node.label)
        return node

    def _node_for(self, root: _Node[V], token_ids: tuple[int, ...]) -> _Node[V]:
        """The node where `token_ids` ends, made (splitting edges) where missing."""
        node, pos = root, 0
        while pos < len(token_ids):
            child = node.children.get(token_ids[pos])
            if child is None:
                child = _Node(token_ids[pos:])
                node.children[token_ids[pos]] = child
                return child
            matched = _common_length(child.label, token_ids[pos:pos + len(child.label)])
            if matched < len(child.label):  # split the edge where the prompts part
                middle = _Node(child.label[:matched], entries=set(child.entries))
                child.label = child.label[matched:]
                middle.children[child.label[0]] = child
                node.children[token_ids[pos]] = middle
                child = middle
            node, pos = child, pos + matched
        return node

    def _path(self, root: _Node[V], token_ids: tuple[int, ...]) -> list[_Node[V]]:
        """The nodes below `root` that `token_ids` (present in the tree) passes through."""
        nodes, node, pos = [], root, 0
        while pos < len(token_ids):
            node = node.children[token_ids[pos]]
            nodes.append(node)
            pos += len(node.label)
        return nodes

    def _remove(self, entry: CachedPrompt[V]) -> None:
        """Drop `entry` (under the lock): off every node it passes, empty nodes pruned."""
        root = self._roots[(entry.namespace, entry.kind)]
        parents = [root, *self._path(root, entry.token_ids)]
        parents[-1].terminal = None
        for parent, node in reversed(list(zip(parents, parents[1:]))):
            node.entries.discard(entry)
            if not node.entries:
                del parent.children[node.label[0]]
        if not root.children:
            del self._roots[(entry.namespace, entry.kind)]
        self._entries.discard(entry)
        self._bytes -= entry.nbytes

    # --- invalidation -------------------------------------------------------------------------------
    def invalidate_chunks(self, chunk_keys: Iterable[str]) -> int:
        """Drop every entry holding one of these chunks (a changed or deleted document's); how many."""
        keys = frozenset(chunk_keys)
        if not keys:
            return 0
        with self._lock:
            self._epoch += 1
            if len(self._invalidated_at) > MAX_INVALIDATED_KEYS:  # the oldest go: a prefill lasts seconds
                self._invalidated_at = dict(list(self._invalidated_at.items())[MAX_INVALIDATED_KEYS // 2:])
            for key in keys:  # re-inserted: the most recent last
                self._invalidated_at.pop(key, None)
                self._invalidated_at[key] = self._epoch
            gone = [e for e in self._entries if e.chunk_keys & keys]
            return self._drop(gone)

    def retain_live(self, is_live: Callable[[str], bool]) -> int:
        """Drop every entry holding a chunk key no stored chunk uses any more (`is_live` is asked once
        per key, outside the lock: it may query a database); how many."""
        with self._lock:
            keys = {key for e in self._entries for key in e.chunk_keys}
        dead = {key for key in keys if not is_live(key)}
        return self.invalidate_chunks(dead)

    def clear(self) -> int:
        """Drop every entry (the store closing); how many."""
        with self._lock:
            return self._drop(list(self._entries), is_invalidation=False)

    def _drop(self, entries: list[CachedPrompt[V]], is_invalidation: bool = True) -> int:
        for entry in entries:
            self._remove(entry)
        if is_invalidation:
            self._counts["invalidations"] += len(entries)
        return len(entries)

    # --- bookkeeping --------------------------------------------------------------------------------
    @property
    def bytes_used(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            return PrefixCacheStats(**self._counts, num_entries=len(self._entries), bytes_used=self._bytes,
                                    max_bytes=self.max_bytes)
