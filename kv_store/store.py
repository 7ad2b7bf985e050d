"""KVStore: the tiers composed, fastest first, with explicit rules.

- read through: `get` tries the GPU tier, memory, disk, then Redis; a hit is promoted into every faster tier;
- write where configured: `put` writes to each enabled tier in `write_tiers`;
- a damaged or mismatched entry is a miss: logged, deleted from its tier, and recomputed by the caller
  (or, mid-request, by the `recompute` function given to `layer_source`);
- stream: `handle` reads headers only; `layer_source` streams layers to the engine, pipelined;
  `promote` then copies streamed chunks up, off the latency path. Within a request each entry is
  opened once (by `handle` or the prefetch) and each layer read once (see `entry.py`).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import torch

from blend_engine.kv import ChunkKV
from configs.settings import Settings
from kv_store.backend import Backend, ChunkInfo, LayerReader, Tier
from kv_store.codec import TORCH_DTYPES
from kv_store.config import StoreConfig
from kv_store.device import DeviceBackend
from kv_store.disk import DiskBackend
from kv_store.entry import OpenEntry, drop_if_corrupt, keep_for_promotion, read_missing_kept
from kv_store.errors import CorruptEntryError, EntryLostError
from kv_store.keys import chunk_key, is_valid_key
from kv_store.loader import StoredChunk, StoreLayerSource
from kv_store.memory import MemoryBackend, MemoryReader
from kv_store.planner import LoadPlan, LoadPlanner, PlanRequest
from kv_store.prefetch import Prefetcher
from kv_store.stats import StoreStats
from kv_store.throttle import ThrottledBackend

log = logging.getLogger(__name__)
RecomputeFn = Callable[[tuple[int, ...], tuple[int, ...]], ChunkKV]  # e.g. engine.precompute


class KVStore:
    def __init__(self, fingerprint: str, config: StoreConfig = StoreConfig()):
        if not fingerprint:
            raise ValueError("a model fingerprint is required")
        self.fingerprint, self.config = fingerprint, config
        self._backends: list[Backend] = []
        if config.max_gpu_bytes > 0:
            self._backends.append(DeviceBackend(config.max_gpu_bytes, TORCH_DTYPES[config.dtype], config.gpu_device))
        if config.max_memory_bytes > 0:
            self._backends.append(MemoryBackend(config.max_memory_bytes, TORCH_DTYPES[config.dtype]))
        if config.disk_dir is not None:
            self._backends.append(
                DiskBackend(config.disk_dir, config.max_disk_bytes, fingerprint, config.remote_format, config.fsync)
            )
        if config.redis_url is not None:
            from kv_store.redis_backend import RedisBackend  # redis-py only when a URL is configured

            self._backends.append(RedisBackend(config.redis_url, config.redis_ttl_s, fingerprint, config.remote_format))
        self._backends = [self._throttled(b) for b in self._backends]
        self.planner = LoadPlanner(config.min_recompute_ratio, config.max_recompute_ratio)
        self._prefetcher = Prefetcher(self._copy_up, config.max_prefetch_bytes) if config.max_memory_bytes > 0 else None
        self._lock = threading.Lock()
        self._num_recovered = 0  # entries recomputed mid-request (and put back)

    def _throttled(self, backend: Backend) -> Backend:
        rate = self.config.throttle_bytes_per_s.get(backend.tier)
        return backend if rate is None else ThrottledBackend(backend, rate)

    @classmethod
    def from_settings(cls, settings: Settings, fingerprint: str) -> KVStore:
        return cls(fingerprint, StoreConfig.from_settings(settings))

    @property
    def tiers(self) -> list[Tier]:
        return [b.tier for b in self._backends]

    def backend(self, tier: Tier) -> Backend:
        for b in self._backends:
            if b.tier == tier:
                return b
        raise KeyError(f"tier {tier.value} is not configured")

    def key_for(self, token_ids: Sequence[int], context_ids: Sequence[int] = ()) -> str:
        return chunk_key(self.fingerprint, self.config.remote_format, token_ids, context_ids)

    # --- whole entries ----------------------------------------------------------------------------
    def get(self, key: str) -> ChunkKV | None:
        """Read through the tiers; a hit is copied into every faster tier."""
        self._check_key(key)
        for idx, b in enumerate(self._backends):
            kv = b.get(key)
            if kv is not None:
                for faster in self._backends[:idx]:
                    faster.put(key, kv)
                return kv
        return None

    def get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        """`get` for several keys, one batched read per tier (e.g. one MGET) for those still missing."""
        for key in keys:
            self._check_key(key)
        found: dict[str, ChunkKV] = {}
        for idx, b in enumerate(self._backends):
            missing = [key for key in dict.fromkeys(keys) if key not in found]
            if not missing:
                break
            for key, kv in zip(missing, b.get_many(missing)):
                if kv is not None:
                    found[key] = kv
                    for faster in self._backends[:idx]:
                        faster.put(key, kv)
        return [found.get(key) for key in keys]

    def put(self, key: str, kv: ChunkKV) -> None:
        self._check_key(key)
        if kv.num_tokens == 0:
            raise ValueError("cannot store an empty chunk")
        if key != self.key_for(kv.token_ids, kv.context_ids):
            raise ValueError(f"key {key[:16]} is not this chunk's key (see key_for)")
        for b in self._backends:
            if b.tier in self.config.write_tiers:
                b.put(key, kv)

    def contains(self, key: str) -> bool:
        self._check_key(key)
        return any(b.contains(key) for b in self._backends)

    def delete(self, key: str) -> None:
        self._check_key(key)
        for b in self._backends:
            b.delete(key)

    def readable_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether some tier holds a sound entry for each key (headers checked on disk, one round
        trip to Redis); a damaged entry found is deleted and counted, so the answer is the truth."""
        for key in keys:
            self._check_key(key)
        found: set[str] = set()
        for b in self._backends:
            missing = [key for key in dict.fromkeys(keys) if key not in found]
            if not missing:
                break
            found.update(key for key, ok in zip(missing, b.readable_many(missing)) if ok)
        return [key in found for key in keys]

    def collect_garbage(self, live_keys: set[str]) -> int:
        """Delete the local entries (memory, disk) no chunk points at any more, e.g. those written by
        an ingest killed before its commit. Redis is shared and expires by itself: left alone.
        Returns how many entries were deleted."""
        num_deleted = 0
        for b in self._backends:
            if b.tier is Tier.REDIS:
                continue
            for key in b.keys_lru_order():
                if key not in live_keys:
                    b.delete(key)
                    num_deleted += 1
        return num_deleted

    @staticmethod
    def _check_key(key: str) -> None:
        if not is_valid_key(key):
            raise ValueError(f"not a chunk key: {key[:80]!r} (use key_for)")

    # --- streaming --------------------------------------------------------------------------------
    def handle(self, key: str) -> StoredChunk | None:
        """The chunk's header from the fastest tier holding it (no tensors are read). Below the memory
        tiers the entry stays open on the handle: `layer_source` and `promote` read through it."""
        self._check_key(key)
        shared = self._prefetcher.entry(key) if self._prefetcher is not None else None
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
    ) -> StoreLayerSource:
        """A `LayerKVSource` over `handles` (prompt order) for `engine.prefill(kv_source=...)`.

        `pipelined`: None = as configured, but only when some chunk lives below the memory tier.
        `start_layer`: the first layer the engine will ask for (blend: its first check layer), where
        prefetching starts. `recompute(token_ids, context_ids)` (e.g. `engine.precompute`) replaces
        a chunk whose entry turns out damaged or gone mid-request; without it that raises.
        Streamed layers of chunks below the fastest tier are kept on their handles for `promote`
        (up to `max_prefetch_bytes` per source, prompt order).
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
                pipelined = self.config.is_pipelined and any(h.tier not in near for h in handles)
            return StoreLayerSource(readers, device, dtype, recover, pipelined, self.config.prefetch_depth, start_layer)
        except BaseException:  # a recovery that raised: the readers already open must not leak
            for reader in readers:
                reader.release() if isinstance(reader, OpenEntry) else reader.close()
            raise

    def _reader_for(self, h: StoredChunk) -> LayerReader | None:
        """The handle's open entry, else the entry opened again (an old or memory-tier handle)."""
        if h.entry is not None and h.entry.is_readable:
            return h.entry
        return self.backend(h.tier).open_reader(h.key, is_lookup=False)

    def _recover(self, h: StoredChunk, exc: Exception, recompute: RecomputeFn | None) -> LayerReader:
        """A reader for a chunk whose entry failed: another tier's copy, else recomputed KV."""
        failed = self.backend(h.tier)
        drop_if_corrupt(failed, h.key, exc)
        for b in self._backends:
            if b is not failed:
                reader = b.open_reader(h.key)
                if reader is not None:
                    return reader
        if recompute is None:
            raise EntryLostError(f"chunk {h.key[:16]} failed ({exc}) and no recompute function was given")
        kv = recompute(h.token_ids, h.context_ids)
        self.put(h.key, kv)  # heal the store for the next request
        with self._lock:
            self._num_recovered += 1
        return MemoryReader(h.key, kv)

    def prefetch(self, keys: Sequence[str]) -> int:
        """Start copying chunks that live below the memory tier up into it, in the background (at
        retrieval, so queue wait hides the load). Bounded bytes in flight; returns how many started.
        A request's `handle` on a chunk still in flight reads through the prefetch's open entry."""
        if self._prefetcher is None or len(self._backends) < 2:
            return 0
        num_started = 0
        for key in dict.fromkeys(keys):
            if self._backends[0].contains(key) or self._prefetcher.entry(key) is not None:
                continue
            for b in self._backends[1:]:
                reader = b.open_reader(key)
                if reader is not None:
                    num_started += self._prefetcher.submit(OpenEntry(key, b, reader, is_shared=True))
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
        return num_copied + sum(self.get(h.key) is not None for h in slower if h.entry is None)

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

    # --- the loading planner -------------------------------------------------------------------
    def plan(self, request: PlanRequest, is_blend_only: bool = False) -> LoadPlan:
        """The loading planner's choice for `request`, from the tiers' measured throughput."""
        throughput = {b.tier: b.counters.snapshot(0).load_throughput for b in self._backends}
        return self.planner.plan(request, throughput, is_blend_only)

    # --- bookkeeping ------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        tiers = {b.tier.value: b.counters.snapshot(b.bytes_used()) for b in self._backends}
        with self._lock:
            num_recovered = self._num_recovered
        return StoreStats(
            tiers=tiers,
            num_recovered=num_recovered,
        )

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
        for b in self._backends:
            b.close()
        self._backends = []


def _stored(info: ChunkInfo, tier: Tier, entry: OpenEntry | None = None) -> StoredChunk:
    return StoredChunk(info.key, tier, info.token_ids, info.context_ids, info.num_layers, info.layer_nbytes, entry)
