"""A stored chunk opened once per request: its header parsed once, each layer's bytes read once.

`KVStore.handle` (or the prefetcher, at retrieval) opens the entry; `layer_source` streams its layers
through it; `promote` then builds the promoted ChunkKV from the layers kept on the way, reading only
the layers the engine never asked for (blend starts at its first check layer), through the same
reader. Reads of one layer of several entries on one tier go out together (Redis: one pipelined
round trip for layer i of every chunk), see `read_many`.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Sequence

import torch

from blend_engine.kv import ChunkKV
from kv_store.backend import Backend, LayerPair, LayerReader, Tier
from kv_store.codec import MAX_REASON_CHARS, EncodedLayer, unpacked
from kv_store.errors import CorruptEntryError, EntryLostError

log = logging.getLogger(__name__)
# a layer as read (packed as stored where the tier can: moved, then unpacked, by the loader), or
# the failure, returned rather than raised
ReadResult = EncodedLayer | CorruptEntryError | EntryLostError


class OpenEntry(LayerReader):
    """One chunk's entry on a slower tier, open for the length of a request (thread-safe).

    Layers read while keeping (`keep_layers`, or always when `is_shared`: a prefetch other requests
    may read through) stay in memory, so the next reader of that layer, or `whole()`, does not read it
    again. The entry outlives the layer sources reading it: `release()` (by `promote`), a failed read,
    or garbage collection closes its reader.
    """

    def __init__(self, key: str, backend: Backend, reader: LayerReader, is_shared: bool = False):
        self.key, self.backend, self.info, self.is_shared = key, backend, reader.info, is_shared
        self._reader: LayerReader | None = reader
        self._layers: list[EncodedLayer | None] = [None] * reader.info.num_layers  # kept host tensors
        self._layer_locks = [threading.Lock() for _ in range(reader.info.num_layers)]
        self._is_keeping = is_shared
        self._failure: CorruptEntryError | EntryLostError | None = None  # why a read failed, for later readers
        self._close_reader = weakref.finalize(self, reader.close)  # an fd must not outlive a dropped handle

    @property
    def tier(self) -> Tier:
        return self.backend.tier

    @property
    def is_open(self) -> bool:
        """Whether layers can still be read (not released, no read failed)."""
        return self._reader is not None

    @property
    def is_readable(self) -> bool:
        """Open, or holding every layer (a prefetch that finished: its reader is closed)."""
        return self._reader is not None or all(layer is not None for layer in self._layers)

    @property
    def num_bytes(self) -> int:
        """Host bytes of the whole entry once read (what keeping every layer holds: a low-bit entry's
        decoded layers, not its payload)."""
        return self.info.num_read_bytes

    def keep_layers(self) -> None:
        """Keep the layers read from now on, for `whole()` (bounded by the caller)."""
        self._is_keeping = True

    def read_layer(self, layer_idx: int, pinned: bool = False) -> LayerPair:
        return unpacked(self.read_layer_encoded(layer_idx, pinned))

    def read_layer_encoded(self, layer_idx: int, pinned: bool = False) -> EncodedLayer:
        result = read_many([(self, layer_idx)], pinned)[0]
        if isinstance(result, Exception):
            raise result
        return result

    def whole(self) -> ChunkKV:
        """The entry as a ChunkKV: the kept layers, plus the missing ones read now (one batched read).
        Raises CorruptEntryError / EntryLostError."""
        layers = []
        for result in read_many([(self, idx) for idx in range(self.info.num_layers)]):
            if isinstance(result, Exception):
                raise result
            layers.append(unpacked(result))
        keys = torch.stack([k for k, _ in layers])  # [L, H, n, D]
        values = torch.stack([v for _, v in layers])  # [L, H, n, D]
        return ChunkKV(self.info.token_ids, self.info.context_ids, keys, values, self.info.salt)

    def close(self) -> None:
        """A layer source is done with the entry: it stays open for `promote` (see `release`)."""

    def close_reader(self) -> None:
        """Close the reader; the kept layers stay for those still reading through the entry."""
        self._reader = None
        self._close_reader()

    def release(self) -> None:
        """Close the reader and drop the kept layers."""
        self.close_reader()
        self._give_up()

    def _give_up(self) -> None:
        # The reader is not closed here: another thread may be mid-read on it (a shared entry);
        # `release` or garbage collection closes it.
        self._reader = None
        self._is_keeping = False
        self._layers = [None] * self.info.num_layers

    def _settle(self, layer_idx: int, result: ReadResult) -> None:
        """Record a read made with the layer's lock held: keep it, or give the entry up if it failed."""
        if isinstance(result, Exception):
            self._failure = result
            self._give_up()  # damaged or gone: whoever reads it next recovers (another tier, recompute)
        elif self._is_keeping:
            self._layers[layer_idx] = result


def read_many(reads: Sequence[tuple[OpenEntry, int]], pinned: bool = False) -> list[ReadResult]:
    """Layer `layer_idx` of each entry: kept layers from memory, the others in one batched read per
    tier (`Backend.read_layer_many`). A layer being read by another thread (a prefetch sharing the
    entry) is waited for, not read twice. Failures come back as exceptions, in place."""
    results: list[ReadResult | None] = [None] * len(reads)
    held, busy = [], []
    try:
        for i, (entry, layer_idx) in enumerate(reads):
            (held if entry._layer_locks[layer_idx].acquire(blocking=False) else busy).append(i)
        _fill(reads, held, pinned, results)
    finally:
        for i in held:
            entry, layer_idx = reads[i]
            entry._layer_locks[layer_idx].release()
    for i in busy:  # never blocks while holding another lock: no lock-order deadlock
        entry, layer_idx = reads[i]
        with entry._layer_locks[layer_idx]:
            _fill(reads, [i], pinned, results)
    return results  # type: ignore[return-value]


def _fill(reads: Sequence[tuple[OpenEntry, int]], indices: list[int], pinned: bool, results: list) -> None:
    """With the layer locks of `indices` held: kept layers, else one read per tier for the rest."""
    by_tier: dict[int, list[tuple[int, LayerReader]]] = {}
    for i in indices:
        entry, layer_idx = reads[i]
        kept, reader = entry._layers[layer_idx], entry._reader  # read once: another thread may give it up
        if kept is not None:
            results[i] = kept
        elif reader is None:
            results[i] = entry._failure or EntryLostError(f"{entry.key[:16]} was released")
        else:
            by_tier.setdefault(id(entry.backend), []).append((i, reader))
    for group in by_tier.values():
        backend = reads[group[0][0]][0].backend
        batch = [(reader, reads[i][1]) for i, reader in group]
        for (i, _), result in zip(group, backend.read_layer_many(batch, pinned)):
            entry, layer_idx = reads[i]
            entry._settle(layer_idx, result)
            results[i] = result


def read_missing_kept(entries: Sequence[OpenEntry]) -> None:
    """Read the layers the keeping entries have not kept yet (blend never asks for those before its
    first check layer) all together: one batched read per tier (Redis: one round trip)."""
    read_many([(e, idx) for e in entries if e._is_keeping for idx, kept in enumerate(e._layers) if kept is None])


def keep_for_promotion(readers: Sequence[LayerReader], max_bytes: int, fastest: Tier) -> None:
    """A layer source's entries below the `fastest` tier keep their streamed layers for `promote`, in
    prompt order while they fit in `max_bytes` (beyond it, `promote` reads those layers again)."""
    for reader in readers:
        if isinstance(reader, OpenEntry) and not reader.is_shared and reader.tier != fastest:
            if reader.num_bytes <= max_bytes:
                reader.keep_layers()
                max_bytes -= reader.num_bytes


def drop_if_corrupt(backend: Backend, key: str, exc: Exception) -> None:
    """A damaged entry is deleted from its tier, and counted once (by whoever deletes it)."""
    if isinstance(exc, CorruptEntryError) and backend.contains(key):
        log.warning("%s KV entry %s is damaged (%s): deleted, will be recomputed", backend.tier.value, key[:16], str(exc)[:MAX_REASON_CHARS])
        backend.delete(key)
        backend.counters.add(corrupt=1)
