"""The `store` section of the settings: the tiered KV store (kv_store/), re-exported by `configs.settings`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from configs.enums import KVQuantization, LoaderPriority, StorageDtype


class StoreSettings(BaseModel):
    max_gpu_bytes: int | None = Field(
        None, ge=0, description="GPU tier bound (LRU of chunk KV on the device, above the memory tier); null: "
        "gpu_memory_share of the free GPU memory at start-up where the model runs on CUDA, else off; 0 disables it.",
    )
    gpu_memory_share: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of the free GPU memory (after the model loaded) the GPU tier takes by default."
    )
    gpu_device: str = Field(
        "cuda", pattern=r"^(cuda(:[0-9]+)?|cpu)$",
        description="Device of the GPU tier: cuda or cuda:N; cpu for tests only, with an explicit max_gpu_bytes.",
    )
    max_memory_bytes: int = Field(2 << 30, ge=0, description="Memory tier bound (LRU); 0 disables it.")
    disk_enabled: bool = Field(True, description="Keep chunk caches on disk (survives restarts).")
    disk_dir: Path | None = Field(None, description="Disk tier directory; default <data_dir>/kv.")
    max_disk_bytes: int = Field(20 << 30, ge=0, description="Disk tier bound (LRU by last use).")
    disk_reserve_bytes: int = Field(
        16 << 20, ge=0, description="Space held in <data_dir>/reserve.bin so that a DELETE can free space on a full "
        "disk (SQLite needs room even to delete): released for it, retaken when there is room; 0: none.",
    )
    redis_url: str | None = Field(None, description="redis://host:port/db of a shared tier; unset = no Redis.")
    redis_ttl_s: int = Field(7 * 86400, ge=1, description="Expiry of Redis entries.")
    database_url: str | None = Field(
        None, description="postgresql://user@host:5432/db of a document store shared by server replicas "
        "(documents, chunks, embeddings; each replica's vector index follows it); unset = SQLite under the data "
        "directory. Design: docs/design/server.md#replicas.",
    )
    database_max_connections: int = Field(8, ge=1, description="Size bound of the Postgres connection pool.")
    database_timeout_s: float = Field(
        5.0, gt=0, description="Seconds a call waits for a Postgres connection before answering 503 (server down)."
    )
    database_poll_s: float = Field(
        1.0, gt=0, description="How often a replica polls the shared store's change log when no NOTIFY arrives "
        "(the fallback; a NOTIFY wakes it at once).",
    )
    lock_ttl_s: float = Field(
        30.0, gt=0, description="Expiry of the Redis lock that makes one replica precompute a chunk's KV while "
        "the others wait for it (a replica that dies holding it frees it after this long).",
    )
    dtype: StorageDtype = Field(StorageDtype.FLOAT16, description="dtype of stored KV.")
    quantization: KVQuantization = Field(KVQuantization.INT4, description="Compression of the disk/Redis tiers' entries: none (float16), int8, or int4 "
        "(keys per channel, values per token, 3.5 bits on average, zstd; docs/decisions/0014). Entries in another format stay readable.")
    write_tiers: list[Literal["gpu", "memory", "disk", "redis"]] = Field(
        ["memory", "disk", "redis"], description="Tiers a new chunk cache is written to (when enabled); the GPU "
        "tier fills on reads by default (a chunk read from a slower tier is copied up).",
    )
    fsync: bool = Field(True, description="fsync disk entries before the atomic rename.")
    pipelined: bool = Field(True, description="Read layer i+1 while the engine computes layer i.")
    prefetch_depth: int = Field(2, ge=1, le=16, description="Layers read ahead of the engine when pipelined.")
    loader_priority: LoaderPriority = Field(
        LoaderPriority.AUTO, description="CPU priority of the threads that read and decode stored KV beside the "
        "engine (a pipelined prefill's reader, the prefetch at retrieval): idle (Linux SCHED_IDLE: they run on cores "
        "the engine leaves free, and whenever the engine waits on them), normal, or auto (idle where the engine "
        "computes on the CPU, whose threads take every core; normal on CUDA). Measured: docs/benchmarks/kv-store.md, "
        "decision 0017.",
    )
    min_recompute_ratio: float = Field(
        0.15, ge=0.0, le=1.0, description="Quality floor of the loading planner's blend ratio (mode or ratio 'auto')."
    )
    max_recompute_ratio: float = Field(1.0, ge=0.0, le=1.0, description="Ceiling of the loading planner's blend ratio.")
    max_prefetch_bytes: int = Field(
        1 << 30, ge=0, description="Bytes of chunk KV copied up into the memory tier at once, started at "
        "retrieval so queue wait hides the load; 0 disables prefetching.",
    )
    planner_profile_tokens: list[int] = Field(
        [64, 256, 1024], min_length=1, description="Prompt lengths of the timed prefills the loading planner's "
        "cost model is fitted on at start-up (then refined by every answer).",
    )
    budgeted: bool = Field(
        True, description="The collection's KV budget: when its KV exceeds the disk tier's bound (the memory "
        "tier's without disk), ingestion precomputes only into free room, and a chunk a question finds without KV "
        "is cached once it is used more (frequency, decayed by recency) than the entries it would evict; the "
        "memory tier fills on use. false: every entry is written and the tiers evict by LRU.",
    )
    use_half_life: int = Field(
        10_000, ge=1, description="Chunk uses (retrievals, store-wide) after which a chunk's use count halves: "
        "how fast the budget forgets old popularity.",
    )
    throttle_mbps: dict[Literal["memory", "disk", "redis"], float] = Field(
        {}, description="Tests and benchmarks: slow a tier down to this many MB/s (simulates a cold disk, a remote tier).",
    )

    @field_validator("throttle_mbps")
    @classmethod
    def _positive_throttles(cls, v: dict[str, float]) -> dict[str, float]:
        if any(mbps <= 0 for mbps in v.values()):
            raise ValueError(f"throttle_mbps values must be > 0, got {v}")
        return v

    @model_validator(mode="after")
    def _gpu_tier_on_cpu_is_explicit(self) -> StoreSettings:
        if self.gpu_device == "cpu" and self.max_gpu_bytes is None:
            raise ValueError("a GPU tier on gpu_device 'cpu' is for tests: give max_gpu_bytes explicitly")
        return self

    @field_validator("planner_profile_tokens")
    @classmethod
    def _positive_sizes(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v):
            raise ValueError(f"planner_profile_tokens must be >= 1, got {v}")
        return v
