"""The store's frozen configuration (the settings' `store` section): the one place its defaults live.

Two values are left for the edge to resolve, each with one meaning: `disk_dir` null means the data
directory's `kv/` (`resolved(data_dir)` fills it in; the store refuses an enabled disk tier without a
directory), and `max_gpu_bytes` null means a share of the free GPU memory where the engine runs on CUDA
(the store works that out when it opens, as it knows the engine's device). No torch here: the settings
import this module without loading the model's libraries.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

from pydantic import ConfigDict, Field, field_validator
from pydantic.dataclasses import dataclass

from configs.enums import KVQuantization, LoaderPriority, StorageDtype, Tier
from kv_store.keys import StorageFormat


@dataclass(frozen=True, config=ConfigDict(extra="forbid", validate_default=True))
class StoreConfig:
    max_gpu_bytes: Annotated[int | None, Field(
        ge=0, description="GPU tier bound (LRU of chunk KV on the device, above the memory tier); null: "
        "gpu_memory_share of the free GPU memory at start-up where the model runs on CUDA, else off; 0 disables "
        "it.")] = None
    gpu_memory_share: Annotated[float, Field(
        gt=0.0, lt=1.0, description="Share of the free GPU memory (after the model loaded) the GPU tier takes by "
        "default.")] = 0.2
    gpu_device: Annotated[str, Field(
        pattern=r"^(cuda(:[0-9]+)?|cpu)$",
        description="Device of the GPU tier: cuda or cuda:N; cpu for tests only, with an explicit "
        "max_gpu_bytes.")] = "cuda"
    max_memory_bytes: Annotated[int, Field(ge=0, description="Memory tier bound (LRU); 0 disables it.")] = 2 << 30
    prefix_cache_bytes: Annotated[int, Field(
        ge=0, description="Bound of the prefix cache: finished prompts' KV kept in memory, in the engine's dtype, "
        "so that a prompt seen before (a repeated question, a chat's follow-up over the same documents) reuses "
        "its longest kept prefix exactly and computes only the rest (LRU); 0 disables it. Apart from the memory "
        "tier's bound. docs/design/kv-store.md#the-prefix-cache.")] = 1 << 30
    disk_enabled: Annotated[bool, Field(description="Keep chunk caches on disk (survives restarts).")] = True
    disk_dir: Annotated[Path | None, Field(description="Disk tier directory; default <data_dir>/kv.")] = None
    max_disk_bytes: Annotated[int, Field(ge=0, description="Disk tier bound (LRU by last use).")] = 20 << 30
    disk_reserve_bytes: Annotated[int, Field(
        ge=0, description="Space held in <data_dir>/reserve.bin so that a DELETE can free space on a full disk "
        "(SQLite needs room even to delete): released for it, retaken when there is room; 0: none.")] = 16 << 20
    redis_url: Annotated[str | None, Field(
        description="redis://host:port/db of a shared tier; unset = no Redis.")] = None
    redis_ttl_s: Annotated[int, Field(ge=1, description="Expiry of Redis entries.")] = 7 * 86400
    lock_ttl_s: Annotated[float, Field(
        gt=0, description="Expiry of the Redis lock that makes one replica precompute a chunk's KV while the "
        "others wait for it (a replica that dies holding it frees it after this long).")] = 30.0
    dtype: Annotated[StorageDtype, Field(description="dtype of stored KV.")] = StorageDtype.FLOAT16
    quantization: Annotated[KVQuantization, Field(
        description="Compression of the disk/Redis tiers' entries: none (float16), int8, or int4 (keys per "
        "channel, values per token, 3.5 bits on average, zstd; docs/decisions/0014). Entries in another format "
        "stay readable.")] = KVQuantization.INT4
    write_tiers: Annotated[frozenset[Tier], Field(
        description="Tiers a new chunk cache is written to (when enabled); the GPU tier fills on reads by "
        "default (a chunk read from a slower tier is copied up).")] = frozenset({Tier.MEMORY, Tier.DISK, Tier.REDIS})
    fsync: Annotated[bool, Field(description="fsync disk entries before the atomic rename.")] = True
    pipelined: Annotated[bool, Field(description="Read layer i+1 while the engine computes layer i.")] = True
    prefetch_depth: Annotated[int, Field(
        ge=1, le=16, description="Layers read ahead of the engine when pipelined.")] = 2
    loader_priority: Annotated[LoaderPriority, Field(
        description="CPU priority of the threads that read and decode stored KV beside the engine (a pipelined "
        "prefill's reader, the prefetch at retrieval): idle (Linux SCHED_IDLE: they run on cores the engine "
        "leaves free, and whenever the engine waits on them), normal, or auto (idle where the engine computes on "
        "the CPU, whose threads take every core; normal on CUDA). Measured: docs/benchmarks/kv-store.md, "
        "decision 0017.")] = LoaderPriority.AUTO
    min_recompute_ratio: Annotated[float, Field(
        ge=0.0, le=1.0, description="Quality floor of the loading planner's blend ratio (mode or ratio "
        "'auto').")] = 0.15
    max_recompute_ratio: Annotated[float, Field(
        ge=0.0, le=1.0, description="Ceiling of the loading planner's blend ratio.")] = 1.0
    max_prefetch_bytes: Annotated[int, Field(
        ge=0, description="Bytes of chunk KV copied up into the memory tier at once, started at retrieval so "
        "queue wait hides the load; 0 disables prefetching.")] = 1 << 30
    planner_profile_tokens: Annotated[tuple[int, ...], Field(
        min_length=1, description="Prompt lengths of the timed prefills the loading planner's cost model is "
        "fitted on at start-up (then refined by every answer).")] = (64, 256, 1024)
    budgeted: Annotated[bool, Field(
        description="The collection's KV budget: when its KV exceeds the disk tier's bound (the memory tier's "
        "without disk), ingestion precomputes only into free room, and a chunk a question finds without KV is "
        "cached once it is used more (frequency, decayed by recency) than the entries it would evict; the memory "
        "tier gets a copy while it has room (evicting nothing), beyond that it fills on use. false: every entry "
        "is written and the tiers evict by LRU.")] = True
    use_half_life: Annotated[int, Field(
        ge=1, description="Chunk uses (retrievals, store-wide) after which a chunk's use count halves: how fast "
        "the budget forgets old popularity.")] = 10_000
    throttle_mbps: Annotated[dict[Tier, float], Field(
        description="Tests and benchmarks: slow a tier (memory, disk, redis) down to this many MB/s (simulates a "
        "cold disk, a remote tier).")] = Field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.gpu_device == "cpu" and self.max_gpu_bytes is None:
            raise ValueError("a GPU tier on gpu_device 'cpu' is for tests: give max_gpu_bytes explicitly")
        if self.min_recompute_ratio > self.max_recompute_ratio:
            raise ValueError(f"need min_recompute_ratio ({self.min_recompute_ratio}) <= "
                             f"max_recompute_ratio ({self.max_recompute_ratio})")
        if any(mbps <= 0 for mbps in self.throttle_mbps.values()):
            raise ValueError(f"throttle_mbps values must be > 0, got {self.throttle_mbps}")
        if Tier.GPU in self.throttle_mbps:
            raise ValueError("throttle_mbps slows the memory, disk or redis tier, not the GPU tier")
        if any(n < 1 for n in self.planner_profile_tokens):
            raise ValueError(f"planner_profile_tokens must be >= 1, got {self.planner_profile_tokens}")

    @field_validator("redis_url")
    @classmethod
    def _empty_is_none(cls, value: str | None) -> str | None:
        return value or None  # RAGBLEND_STORE__REDIS_URL= (empty) turns the tier off

    @field_validator("disk_dir")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return None if value is None else value.expanduser()

    def resolved(self, data_dir: Path) -> StoreConfig:
        """This config with the disk tier's default directory, `<data_dir>/kv`, filled in."""
        if not self.disk_enabled or self.disk_dir is not None:
            return self
        return replace(self, disk_dir=(data_dir / "kv").expanduser())

    @property
    def disk_path(self) -> Path | None:
        """The disk tier's directory, None when it is off. ValueError when it is on but unresolved."""
        if not self.disk_enabled:
            return None
        if self.disk_dir is None:
            raise ValueError("store.disk_dir is unset: resolve it against the data directory (StoreConfig.resolved)")
        return self.disk_dir

    @property
    def throttle_bytes_per_s(self) -> dict[Tier, float]:
        return {tier: mbps * 1e6 for tier, mbps in self.throttle_mbps.items()}

    @property
    def memory_format(self) -> StorageFormat:
        return StorageFormat(self.dtype)

    @property
    def remote_format(self) -> StorageFormat:
        """Format of the disk and Redis tiers (optionally quantized)."""
        return StorageFormat(self.dtype, self.quantization)
