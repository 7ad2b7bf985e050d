"""Memory tier: an LRU of ChunkKVs on CPU, bounded by bytes, thread-safe.

On CUDA hosts the entries are pinned once, at `put`: a layer then crosses PCIe by DMA, asynchronously,
with no per-read staging copy. The GPU tier (kv_store/device.py) is this LRU on a torch device.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from blend_engine.kv import ChunkKV
from kv_store.backend import Backend, ChunkInfo, LayerReader, Tier


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

    def close(self) -> None:
        self._kv = None  # type: ignore[assignment]


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
        """The entry as this tier holds it: on CPU in the storage dtype, pinned where CUDA is."""
        kv = kv.to("cpu", self._dtype)
        if self.is_pinned and not kv.keys.is_pinned():
            kv = ChunkKV(kv.token_ids, kv.context_ids, kv.keys.pin_memory(), kv.values.pin_memory())
        return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        if 2 * kv.keys.numel() * self._dtype.itemsize > self.max_bytes:  # keys + values, stored
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
