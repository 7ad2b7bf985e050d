"""KVStore: the tiers composed, fastest first, with explicit rules.

- read through: `get` tries the GPU tier, memory, disk, then Redis; a hit is promoted into every faster tier;
- write where configured: `put` writes to each enabled tier in `write_tiers`;
- a damaged or mismatched entry is a miss: logged, deleted from its tier, and recomputed by the caller
  (or, mid-request, by the `recompute` function given to `layer_source`). The store knows its model's
  fingerprint and KV shape: an entry of another model, key, token ids or shape is such an entry;
- stream: `handle` reads headers only; `layer_source` streams layers to the engine, pipelined;
  `promote` then copies streamed chunks up, off the latency path. Within a request each entry is
  opened once (by `handle` or the prefetch) and each layer read once (see `entry.py`).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Sequence

import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import LoaderPriority
from kv_store.admission import Admission, AdmissionPolicy, BudgetStats
from kv_store.backend import Backend, Tier
from kv_store.codec import TORCH_DTYPES
from kv_store.config import StoreConfig
from kv_store.device import DeviceBackend, check_device, default_gpu_bytes
from kv_store.disk import DiskBackend
from kv_store.errors import CorruptEntryError, EntryLostError
from kv_store.keys import KVScope, chunk_key, is_valid_key
from kv_store.loader import StoredChunk, StoreLayerSource
from kv_store.memory import MemoryBackend
from kv_store.planner import LoadPlan, LoadPlanner, PlanRequest
from kv_store.prefix_cache import PrefixCache
from kv_store.stats import StoreStats
from kv_store.streaming import RecomputeFn, StoreStreaming
from kv_store.throttle import ThrottledBackend

log = logging.getLogger(__name__)


class KVStore:
    """The chunk KV of one model: `fingerprint` (its weights and format) and `shape` (what each of its
    chunks' KV holds besides the tokens, `engine.kv_shape`) say which entries are its own."""

    def __init__(self, fingerprint: str, config: StoreConfig = StoreConfig(disk_enabled=False),
                 engine_device_type: str = "cpu", *, shape: KVShape):
        """`engine_device_type` ("cpu", "cuda"): where the engine computes; the GPU tier's default bound and
        the loader threads' `auto` priority resolve against it."""
        if not fingerprint:
            raise ValueError("a model fingerprint is required")
        if engine_device_type not in ("cpu", "cuda"):
            raise ValueError(f"engine_device_type must be cpu or cuda, got {engine_device_type!r}")
        self.fingerprint, self.config, self.shape = fingerprint, config, shape
        self._backends: list[Backend] = []
        max_gpu_bytes = config.max_gpu_bytes
        if max_gpu_bytes is None:  # a share of what the loaded model left free, where it runs on CUDA
            max_gpu_bytes = default_gpu_bytes(config.gpu_memory_share, config.gpu_device, engine_device_type == "cuda")
        if max_gpu_bytes > 0:
            check_device(config.gpu_device)
            self._backends.append(DeviceBackend(max_gpu_bytes, TORCH_DTYPES[config.dtype], config.gpu_device))
        if config.max_memory_bytes > 0:
            self._backends.append(MemoryBackend(config.max_memory_bytes, TORCH_DTYPES[config.dtype]))
        disk_dir = config.disk_path
        if disk_dir is not None:
            self._backends.append(
                DiskBackend(disk_dir, config.max_disk_bytes, fingerprint, config.remote_format, shape, config.fsync)
            )
        if config.redis_url is not None:
            from kv_store.redis_backend import RedisBackend  # redis-py only when a URL is configured

            self._backends.append(RedisBackend(config.redis_url, config.redis_ttl_s, fingerprint, config.remote_format,
                                               shape))
        self._budgeted = self._budget_tier()
        self.admission = self._admission(config) if self._budgeted is not None else None
        self._backends = [self._throttled(b) for b in self._backends]
        self.planner = LoadPlanner(config.min_recompute_ratio, config.max_recompute_ratio)
        # finished prompts' KV (the executor the server builds keeps them here; the writers invalidate)
        self.prompts: PrefixCache = PrefixCache(config.prefix_cache_bytes)
        # a chunk recomputed mid-request is put back under its own key (its salt read from its header)
        self._streaming = StoreStreaming(self._backends, config, lambda key, kv: self.put(key, kv, kv.salt), self.get,
                                         self.backend, engine_device_type)
        self._prefetcher = self._streaming.prefetcher

    def _budget_tier(self) -> DiskBackend | MemoryBackend | None:
        """The tier whose bound is the collection's KV budget: disk (persistent), else memory."""
        for cls in (DiskBackend, MemoryBackend):
            for b in self._backends:
                if type(b) is cls and b.tier in self.config.write_tiers:
                    return b
        return None

    def _admission(self, config: StoreConfig) -> AdmissionPolicy:
        tier = self._budgeted
        victims = tier.victims if config.budgeted else None
        return AdmissionPolicy(tier, tier.max_bytes, config.use_half_life, victims=victims)

    def _throttled(self, backend: Backend) -> Backend:
        rate = self.config.throttle_bytes_per_s.get(backend.tier)
        return backend if rate is None else ThrottledBackend(backend, rate)

    @property
    def tiers(self) -> list[Tier]:
        return [b.tier for b in self._backends]

    def backend(self, tier: Tier) -> Backend:
        for b in self._backends:
            if b.tier == tier:
                return b
        raise KeyError(f"tier {tier.value} is not configured")

    def key_for(self, token_ids: Sequence[int], context_ids: Sequence[int] = (), salt: str = "") -> str:
        """The entry's key for a chunk of a collection with this KV salt (kv_store/keys.py)."""
        return chunk_key(self.fingerprint, self.config.remote_format, token_ids, context_ids, salt)

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

    def put(self, key: str, kv: ChunkKV, salt: str = "") -> None:
        """Write to every tier in `write_tiers`, unconditionally (see `offer` for the budgeted write)."""
        self._put_to(key, kv, set(self.config.write_tiers), KVScope(salt))

    def offer(self, key: str, kv: ChunkKV, why: Admission, scope: KVScope = KVScope()) -> bool:
        """Write `kv` if the collection's budget admits it (see admission.py); True when written.

        A precomputed entry (ingestion) is written to the tiers below memory, and copied into the memory
        tier only while that has room without evicting (`_fill_memory_with_room`); beyond, the memory tier
        fills on use (promote after an answer, prefetch). Unbudgeted (`budgeted: false`) every entry
        is written as `put` writes it."""
        if self.admission is None or not self.config.budgeted:
            self._put_to(key, kv, set(self.config.write_tiers), scope)
            return True
        num_bytes = self.admission.estimated_bytes(kv.num_tokens) or 0
        victims = self.admission.decide(key, num_bytes, why, scope=scope)
        if victims is None:
            return False
        for victim in victims:  # the collection's own lower-scored entries, to stay within its own budget
            self._budgeted.delete(victim)
        tiers = self._offer_tiers(why)
        self._put_to(key, kv, tiers, scope)
        if Tier.MEMORY not in tiers:
            self._fill_memory_with_room(key, kv.num_tokens)
        return True

    def _fill_memory_with_room(self, key: str, num_tokens: int) -> bool:
        """A precomputed entry copied into the memory tier while that has room for it without evicting
        anything: a first question about a new document then reads it there, not decoded from disk
        beside its prefill (issue 38: that decode made a first ask 1.22x 64caae7's, whose entries were all
        in memory). The copy is read back from the tier below, so it holds the values a read from there
        gives (an int4 entry's, rounded as a promoted copy is: kv_store/codec.py), and an answer does not
        depend on the tier its KV came from. Whether copied."""
        memory = next((b for b in self._backends if b.tier is Tier.MEMORY), None)
        if memory is None:
            return False
        shape = self.shape
        if not memory.has_room_for(shape.num_layers * shape.num_kv_heads * num_tokens * shape.head_dim) \
                or memory.contains(key):
            return False
        below = next((b for b in self._backends if b.tier is Tier.DISK), None)  # Redis: not a round trip more
        reader = below.open_reader(key, is_lookup=False) if below is not None else None  # not a question's hit
        if reader is None:
            return False
        try:  # its layers count in the tier's load figures, as a first question's read of the entry did
            layers = [reader.read_layer(layer_idx) for layer_idx in range(shape.num_layers)]  # [(k, v) [H, n, D]]
        except (CorruptEntryError, EntryLostError):
            return False  # left to the next read, which deletes and recomputes it
        finally:
            reader.close()
        info = reader.info
        memory.put(key, ChunkKV(info.token_ids, info.context_ids, torch.stack([k for k, _ in layers]),
                                torch.stack([v for _, v in layers]), info.salt))  # [L, H, n, D] each
        return True

    def should_compute(self, key: str, num_tokens: int, why: Admission, scope: KVScope = KVScope()) -> bool:
        """Whether an entry of `num_tokens` would be admitted, asked before computing it (yes while its
        size is unknown: no entry written yet). A no is counted as a rejection; `offer` decides for good."""
        if self.admission is None or not self.config.budgeted:
            return True
        num_bytes = self.admission.estimated_bytes(num_tokens)
        return num_bytes is None or self.admission.admits(key, num_bytes, why, is_final=False, scope=scope)

    def _offer_tiers(self, why: Admission) -> set[Tier]:
        tiers = set(self.config.write_tiers)
        if why is Admission.PRECOMPUTE and self._budgeted.tier is not Tier.MEMORY:
            tiers -= {Tier.GPU, Tier.MEMORY}
        return tiers

    def _put_to(self, key: str, kv: ChunkKV, tiers: set[Tier], scope: KVScope) -> None:
        self._check_key(key)
        if kv.num_tokens == 0:
            raise ValueError("cannot store an empty chunk")
        if key != self.key_for(kv.token_ids, kv.context_ids, scope.salt):
            raise ValueError(f"key {key[:16]} is not this chunk's key under its collection's salt (see key_for)")
        if kv.salt != scope.salt:  # recorded in the stored entry, so a reader can check its key
            kv = replace(kv, salt=scope.salt)
        if kv.shape != self.shape:
            raise ValueError(f"a chunk of KV shape {kv.shape} in a store of the model's {self.shape}")
        for b in self._backends:
            if b.tier in tiers:
                b.put(key, kv)
        if self.admission is not None:
            size = self._budgeted.sizes_of([key])[0]
            if size is not None:
                self.admission.observe_written(kv.num_tokens, size)
                self.admission.note_owner(key, scope.owner)

    def owner_bytes(self, owner: str) -> int | None:
        """Bytes of the budgeted tier's entries accounted to collection `owner` (None: no budgeted tier)."""
        return self.admission.owner_bytes(owner) if self.admission is not None else None

    def entry_bytes(self, keys: Sequence[str]) -> list[int | None]:
        """Each key's bytes in the budgeted tier (its index: no I/O), None where it holds none."""
        if self._budgeted is None:
            return [None] * len(keys)
        return self._budgeted.sizes_of(keys)

    def budget_stats(self) -> BudgetStats | None:
        return self.admission.stats() if self.admission is not None else None

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

    # --- streaming (see streaming.py) ---------------------------------------------------------------
    def handle(self, key: str) -> StoredChunk | None:
        """The chunk's header (a question's use of it: counted for the collection's budget)."""
        self._check_key(key)
        found = self._streaming.handle(key)
        if self.admission is not None:
            self.admission.note_uses([key], [found is not None])
        return found

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
        return self._streaming.layer_source(handles, device, dtype, pipelined, start_layer, recompute, loader_priority)

    def prefetch(self, keys: Sequence[str]) -> int:
        return self._streaming.prefetch(keys)

    def promote(self, handles: Sequence[StoredChunk]) -> int:
        return self._streaming.promote(handles)

    # --- the loading planner -------------------------------------------------------------------
    def plan(self, request: PlanRequest, is_blend_only: bool = False) -> LoadPlan:
        """The loading planner's choice for `request`, from the tiers' measured throughput."""
        throughput = {b.tier: b.counters.snapshot(0).load_throughput for b in self._backends}
        return self.planner.plan(request, throughput, is_blend_only)

    # --- bookkeeping ------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        tiers = {b.tier.value: b.counters.snapshot(b.bytes_used()) for b in self._backends}
        return StoreStats(
            tiers=tiers,
            num_recovered=self._streaming.num_recovered,
            budget=self.budget_stats(),
            prefix=self.prompts.stats(),
        )

    def close(self) -> None:
        self.prompts.clear()
        if self._prefetcher is not None:
            self._prefetcher.close()
        for b in self._backends:
            b.close()
        self._backends.clear()  # the list is shared with the streaming side
