"""Memory tier: an LRU of ChunkKVs on CPU, bounded by bytes, thread-safe.

On CUDA hosts the entries are pinned once, at `put`: a layer then crosses PCIe by DMA, asynchronously,
with no per-read staging copy. Each entry's keys and values live in one block laid out
[layers, 2, H, n, D], so a layer's K and V are adjacent and move to the GPU in one copy
(`read_layer_encoded` hands them over as a `StackedLayer`). The GPU tier (kv_store/device.py) is this
LRU on a torch device.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from blend_engine.kv import ChunkKV
from kv_store.backend import Backend, ChunkInfo, LayerReader, Tier
from kv_store.codec import EncodedLayer, StackedLayer


class MemoryReader(LayerReader):
    """Per-layer views of a ChunkKV already in memory."""

    def __init__(self, key: str, kv: ChunkKV):
        self.info = ChunkInfo.from_kv(key, kv)
        self._kv = kv

    def read_layer(self, layer_idx: int, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._kv.keys[layer_idx], self._kv.values[layer_idx]  # [H, n, D] views
        if pinned and not k.is_cuda and not k.is_pinned():  # pinned at put on CUDA hosts: no copy here
            k, v = k.pin_memory(), v.pin_memory()
        return k, v

    def read_layer_encoded(self, layer_idx: int, pinned: bool = False) -> EncodedLayer:
        block = _stacked_block(self._kv)
        if block is None:  # an entry not laid out by this tier (e.g. the GPU tier's): two views
            return self.read_layer(layer_idx, pinned)
        layer = block[layer_idx]  # [2, H, n, D], contiguous: one copy to move
        if pinned and not layer.is_cuda and not layer.is_pinned():
            layer = layer.pin_memory()
        return StackedLayer(layer)

    def close(self) -> None:
        self._kv = None  # type: ignore[assignment]


def _stacked_block(kv: ChunkKV) -> torch.Tensor | None:
    """The [L, 2, H, n, D] block that `kv`'s keys and values are views of, if they are."""
    block = kv.keys._base
    if block is None or block is not kv.values._base or block.dim() != 5 or block.shape[1] != 2:
        return None
    return block if block.shape[0] == kv.num_layers else None


def _stacked(kv: ChunkKV, dtype: torch.dtype, is_pinned: bool) -> ChunkKV:
    """`kv` on CPU in `dtype`, keys and values as views of one [L, 2, H, n, D] block (pinned or not)."""
    block = torch.empty((kv.keys.shape[0], 2, *kv.keys.shape[1:]), dtype=dtype, pin_memory=is_pinned)
    block[:, 0].copy_(kv.keys)
    block[:, 1].copy_(kv.values)
    return ChunkKV(kv.token_ids, kv.context_ids, block[:, 0], block[:, 1], kv.salt)


class MemoryBackend(Backend):
    """Entries are stored in the storage dtype; `get` returns the stored object (treat it as read-only).

    `is_pinned` (default: on CUDA hosts) keeps the tensors in page-locked memory, pinned once at `put`.
    """

    tier = Tier.MEMORY

    def __init__(self, max_bytes: int, dtype: torch.dtype, is_pinned: bool | None = None):
        super().__init__()
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._dtype = dtype
        self.is_pinned = torch.cuda.is_available() if is_pinned is None else is_pinned
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, ChunkKV] = OrderedDict()  # least recently used first
        self._num_bytes = 0

    def get(self, key: str, is_lookup: bool = True) -> ChunkKV | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
        if not is_lookup:
            return kv
        if kv is None:
            self.counters.add(misses=1)
        else:
            self.counters.add(hits=1, bytes_read=kv.nbytes)
        return kv

    def _place(self, kv: ChunkKV) -> ChunkKV:
        """The entry as this tier holds it: on CPU in the storage dtype, K and V of a layer side by side
        in one block, pinned where CUDA is."""
        return _stacked(kv, self._dtype, self.is_pinned)

    def stored_bytes(self, num_key_elements: int) -> int:
        """What an entry with this many key elements (and as many values) takes here."""
        return 2 * num_key_elements * self._dtype.itemsize

    def has_room_for(self, num_key_elements: int) -> bool:
        """Whether such an entry fits now without evicting anything."""
        with self._lock:
            return self._num_bytes + self.stored_bytes(num_key_elements) <= self.max_bytes

    def put(self, key: str, kv: ChunkKV) -> None:
        if self.stored_bytes(kv.keys.numel()) > self.max_bytes:
            return  # would evict everything and still not fit: not even copied
        kv = self._place(kv)
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old.nbytes
            self._entries[key] = kv
            self._num_bytes += kv.nbytes
            num_evicted = self._evict_locked()
        self.counters.add(bytes_written=kv.nbytes, evictions=num_evicted)

    def _evict_locked(self) -> int:
        num_evicted = 0
        while self._num_bytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self._num_bytes -= old.nbytes
            num_evicted += 1
        return num_evicted

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old.nbytes

    def readable_many(self, keys) -> list[bool]:
        return [self.contains(key) for key in keys]

    def keys_lru_order(self) -> list[str]:
        """Least recently used first (for tests and debugging)."""
        with self._lock:
            return list(self._entries)

    def victims(self, num_bytes: int) -> list[str]:
        """The least recently used keys whose entries add up to `num_bytes`."""
        out, total = [], 0
        with self._lock:
            for key, kv in self._entries.items():
                if total >= num_bytes:
                    break
                out.append(key)
                total += kv.nbytes
        return out

    def sizes_of(self, keys) -> list[int | None]:
        with self._lock:
            return [None if (kv := self._entries.get(key)) is None else kv.nbytes for key in keys]

    def open_reader(self, key: str, is_lookup: bool = True) -> MemoryReader | None:
        kv = self.get(key, is_lookup)
        return None if kv is None else MemoryReader(key, kv)

    def bytes_used(self) -> int:
        with self._lock:
            return self._num_bytes

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._num_bytes = 0
