"""A slow tier on any machine: wraps a backend and sleeps per byte and per read.

For tests and benchmarks (`store.throttle_mbps`, `ragblend bench kv --throttle-mbps disk=20`): on a
CPU host loads are ~2% of recompute, so the regime where loading dominates (a cold disk, a remote
tier, a GPU that computes 100x faster) can only be shown by slowing a tier down. The sleep is
counted in the tier's load time, so the planner measures the throughput a real slow tier would show.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from blend_engine.kv import ChunkKV
from kv_store.backend import Backend, ChunkInfo, LayerReader
from kv_store.codec import EncodedLayer


class ThrottledReader(LayerReader):
    def __init__(self, inner: LayerReader, backend: ThrottledBackend):
        self.info = inner.info
        self._inner, self._backend = inner, backend

    def read_layer(self, layer_idx: int, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        self._backend.wait(self.info.layer_nbytes)
        return self._inner.read_layer(layer_idx, pinned)

    def read_layer_encoded(self, layer_idx: int, pinned: bool = False) -> EncodedLayer:
        self._backend.wait(self.info.layer_nbytes)
        return self._inner.read_layer_encoded(layer_idx, pinned)

    def close(self) -> None:
        self._inner.close()


class ThrottledBackend(Backend):
    """`inner`, at most `bytes_per_s`, plus `latency_s` per read (a layer, or a whole entry)."""

    def __init__(self, inner: Backend, bytes_per_s: float, latency_s: float = 0.0):
        if bytes_per_s <= 0 or latency_s < 0:
            raise ValueError(f"a throttle needs bytes_per_s > 0 and latency_s >= 0, got {bytes_per_s}, {latency_s}")
        self.tier, self.counters = inner.tier, inner.counters  # one set of counters for the tier
        self.inner, self.bytes_per_s, self.latency_s = inner, bytes_per_s, latency_s

    def __getattr__(self, name: str):
        # tier-specific methods (the disk tier's paths, its start-up garbage collection) are the inner tier's
        if name == "inner":  # not set yet (e.g. mid-construction): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def wait(self, num_bytes: int) -> None:
        seconds = self.latency_s + num_bytes / self.bytes_per_s
        time.sleep(seconds)
        self.counters.add(load_seconds=seconds)

    def get(self, key: str) -> ChunkKV | None:
        kv = self.inner.get(key)
        if kv is not None:
            self.wait(kv.nbytes)
        return kv

    def put(self, key: str, kv: ChunkKV) -> None:
        self.inner.put(key, kv)

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def info(self, key: str) -> ChunkInfo | None:
        return self.inner.info(key)

    def read_layer_many(self, reads: Sequence[tuple[LayerReader, int]], pinned: bool = False) -> list:
        """The inner tier's batched read, after the sleep each layer's read would cost."""
        inner = []
        for reader, layer_idx in reads:
            self.wait(reader.info.layer_nbytes)
            inner.append((reader._inner if isinstance(reader, ThrottledReader) else reader, layer_idx))
        return self.inner.read_layer_many(inner, pinned)

    def open_reader(self, key: str, is_lookup: bool = True) -> LayerReader | None:
        reader = self.inner.open_reader(key, is_lookup)
        return None if reader is None else ThrottledReader(reader, self)

    def bytes_used(self) -> int:
        return self.inner.bytes_used()

    def close(self) -> None:
        self.inner.close()
