"""The request side of a KVStore: stream a request's chunks layer by layer, then copy them up.

- `handle` reads headers only; `layer_source` streams layers to the engine, pipelined;
- a chunk whose entry fails mid-request is read from another tier, else recomputed and put back;
- `prefetch` copies chunks up into memory in the background from retrieval on;
  `promote` then copies streamed chunks up, off the latency path. Within a request each entry is
  opened once (by `handle` or the prefetch) and each layer read once (see `entry.py`).
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Callable, Sequence

import torch

from blend_engine.kv import ChunkKV
from configs.enums import LoaderPriority
from kv_store.backend import Backend, ChunkInfo, LayerReader, Tier
from kv_store.config import StoreConfig
from kv_store.entry import OpenEntry, drop_if_corrupt, keep_for_promotion, read_missing_kept
from kv_store.errors import CorruptEntryError, EntryLostError
from kv_store.loader import StoredChunk, StoreLayerSource
from kv_store.memory import MemoryReader
from kv_store.prefetch import Prefetcher

RecomputeFn = Callable[[tuple[int, ...], tuple[int, ...]], ChunkKV]  # e.g. engine.precompute


class StoreStreaming:
    """Streams from the store's tiers; writes and whole-entry reads go through the store's own
    `put` / `get` / `backend` (given here), so the tier rules stay in one place."""

    def __init__(
        self,
        backends: list[Backend],
        config: StoreConfig,
        put: Callable[[str, ChunkKV], None],
        get: Callable[[str], ChunkKV | None],
        backend: Callable[[Tier], Backend],
        engine_device_type: str,
    ):
        self._backends = backends  # the store's list itself (fastest first), emptied by its `close`
        self.config = config
        self._put, self._get, self._backend = put, get, backend
        is_prefetch_idle = config.loader_priority.is_idle_beside(engine_device_type)
        self.prefetcher = (Prefetcher(self._copy_up, config.max_prefetch_bytes, is_prefetch_idle)
                           if config.max_memory_bytes > 0 else None)
        self._lock = threading.Lock()
        self._num_recovered = 0  # entries recomputed mid-request (and put back)

    @property
    def num_recovered(self) -> int:
        with self._lock:
            return self._num_recovered

    def handle(self, key: str) -> StoredChunk | None:
        """The chunk's header from the fastest tier holding it (no tensors are read). Below the memory
        tiers the entry stays open on the handle: `layer_source` and `promote` read through it."""
        shared = self.prefetcher.entry(key) if self.prefetcher is not None else None
        if shared is not None and shared.is_readable:  # being copied up since retrieval: read through it
            return _stored(shared.info, shared.tier, shared)
        for b in self._backends:
            if b.tier in (Tier.GPU, Tier.MEMORY):  # tensors held: nothing to open
                info = b.info(key)
                if info is not None:
                    return _stored(info, b.tier)
                continue
            reader = b.open_reader(key)
            if reader is not None:
                return _stored(reader.info, b.tier, OpenEntry(key, b, reader))
        return None

    def layer_source(
        self,
        handles: Sequence[StoredChunk],
        device: torch.device | str,
        dtype: torch.dtype,
        pipelined: bool | None = None,
        start_layer: int = 0,
        recompute: RecomputeFn | None = None,
        loader_priority: LoaderPriority | None = None,
    ) -> StoreLayerSource:
        """A `LayerKVSource` over `handles` (prompt order) for `engine.prefill(kv_source=...)`.

        `pipelined`: None = as configured, but only when some chunk lives below the memory tier.
        `start_layer`: the first layer the engine will ask for (blend: its first check layer), where
        prefetching starts. `recompute(token_ids, context_ids)` (e.g. `engine.precompute`) replaces
        a chunk whose entry turns out damaged or gone mid-request; without it that raises.
        Streamed layers of chunks below the fastest tier are kept on their handles for `promote`
        (up to `max_prefetch_bytes` per source, prompt order). `loader_priority`: the reader thread's
        (None: as configured).
        """
        handles = list(handles)

        def recover(chunk_idx: int, exc: Exception) -> LayerReader:
            return self._recover(handles[chunk_idx], exc, recompute)

        readers: list[LayerReader] = []
        try:
            for idx, h in enumerate(handles):
                reader = self._reader_for(h)
                readers.append(reader if reader is not None else recover(idx, EntryLostError(f"{h.key[:16]} is gone")))
            keep_for_promotion(readers, self.config.max_prefetch_bytes, self._backends[0].tier)
            if pipelined is None:
                # Reading from the memory tier is a copy with nothing to hide, and a reader thread would
                # only compete with the engine's compute threads for the cores (measured: ~8% slower). On
                # CUDA its layers cross PCIe, worth hiding (issue 8: 242 -> 118 ms); the GPU tier's are views.
                near = (Tier.GPU,) if torch.device(device).type == "cuda" else (Tier.GPU, Tier.MEMORY)
                pipelined = self.config.pipelined and any(h.tier not in near for h in handles)
            priority = self.config.loader_priority if loader_priority is None else loader_priority
            return StoreLayerSource(readers, device, dtype, recover, pipelined, self.config.prefetch_depth, start_layer,
                                    priority.is_idle_beside(torch.device(device).type))
        except BaseException:  # a recovery that raised: the readers already open must not leak
            for reader in readers:
                reader.release() if isinstance(reader, OpenEntry) else reader.close()
            raise

    def _reader_for(self, h: StoredChunk) -> LayerReader | None:
        """The handle's open entry, else the entry opened again (an old or memory-tier handle)."""
        if h.entry is not None and h.entry.is_readable:
            return h.entry
        return self._backend(h.tier).open_reader(h.key, is_lookup=False)

    def _recover(self, h: StoredChunk, exc: Exception, recompute: RecomputeFn | None) -> LayerReader:
        """A reader for a chunk whose entry failed: another tier's copy, else recomputed KV."""
        failed = self._backend(h.tier)
        drop_if_corrupt(failed, h.key, exc)
        for b in self._backends:
            if b is not failed:
                reader = b.open_reader(h.key)
                if reader is not None:
                    return reader
        if recompute is None:
            raise EntryLostError(f"chunk {h.key[:16]} failed ({exc}) and no recompute function was given")
        kv = replace(recompute(h.token_ids, h.context_ids), salt=h.salt)  # under the key it was stored with
        self._put(h.key, kv)  # heal the store for the next request
        with self._lock:
            self._num_recovered += 1
        return MemoryReader(h.key, kv)

    def prefetch(self, keys: Sequence[str]) -> int:
        """Start copying chunks that live below the memory tier up into it, in the background (at
        retrieval, so queue wait hides the load). Bounded bytes in flight; returns how many started.
        A request's `handle` on a chunk still in flight reads through the prefetch's open entry."""
        if self.prefetcher is None or len(self._backends) < 2:
            return 0
        num_started = 0
        for key in dict.fromkeys(keys):
            if self._backends[0].contains(key) or self.prefetcher.entry(key) is not None:
                continue
            for b in self._backends[1:]:
                reader = b.open_reader(key)
                if reader is not None:
                    num_started += self.prefetcher.submit(OpenEntry(key, b, reader, is_shared=True))
                    break
        return num_started

    def promote(self, handles: Sequence[StoredChunk]) -> int:
        """Copy streamed chunks up into the faster tiers (streaming itself leaves them where they are),
        from the layers kept while streaming plus those never streamed, read once through the handle's
        open entry; then the entry is released. Call it off the latency path (e.g. after the answer).
        Returns how many chunks were copied up."""
        fastest = self._backends[0].tier if self._backends else None
        slower = [h for h in handles if h.tier != fastest]
        entries = [h.entry for h in slower if h.entry is not None and not h.entry.is_shared and h.entry.is_open]
        read_missing_kept(entries)  # a shared entry is the prefetcher's to copy up
        num_copied = sum(self._copy_up(entry) for entry in entries)
        # a handle made elsewhere (no entry): read through the tiers, as `get`
        return num_copied + sum(self._get(h.key) is not None for h in slower if h.entry is None)

    def _copy_up(self, entry: OpenEntry) -> bool:
        """Put `entry` into every tier faster than its own, then close its reader (a shared entry keeps
        its layers for the requests reading through it). False if it failed to read."""
        try:
            kv = entry.whole()
            for faster in self._backends[: self._backends.index(entry.backend)]:
                faster.put(entry.key, kv)  # before the reader closes: a `handle` meanwhile finds it above
        except (CorruptEntryError, EntryLostError) as exc:
            drop_if_corrupt(entry.backend, entry.key, exc)
            return False
        finally:
            entry.close_reader() if entry.is_shared else entry.release()
        return True


def _stored(info: ChunkInfo, tier: Tier, entry: OpenEntry | None = None) -> StoredChunk:
    return StoredChunk(info.key, tier, info.token_ids, info.context_ids, info.num_layers, info.layer_nbytes, entry,
                       info.salt)
