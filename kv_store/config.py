"""The store's frozen configuration, resolved from `configs.StoreSettings` (paths made absolute)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from configs.settings import KVQuantization, LoaderPriority, Settings, StorageDtype
from kv_store.backend import Tier
from kv_store.device import check_device, default_gpu_bytes
from kv_store.keys import StorageFormat


@dataclass(frozen=True)
class StoreConfig:
    max_gpu_bytes: int = 0  # 0 = no GPU tier (see from_settings for its default on CUDA hosts)
    gpu_device: str = "cuda"  # where the GPU tier holds its entries ("cpu": tests)
    max_memory_bytes: int = 2 << 30  # 0 = no memory tier
    disk_dir: Path | None = None  # None = no disk tier
    max_disk_bytes: int = 20 << 30
    redis_url: str | None = None  # None = no Redis tier
    redis_ttl_s: int = 7 * 86400
    dtype: StorageDtype = StorageDtype.FLOAT16
    quantization: KVQuantization = KVQuantization.NONE  # the disk and Redis tiers' (settings default: int4)
    write_tiers: frozenset[Tier] = frozenset(Tier)
    fsync: bool = True
    is_pipelined: bool = True
    prefetch_depth: int = 2
    loader_priority: LoaderPriority = LoaderPriority.AUTO  # of the reader threads (a pipelined prefill's, the prefetch's)
    engine_device_type: str = "cpu"  # where the engine computes ("cpu", "cuda"): what `auto` resolves against for the prefetch
    min_recompute_ratio: float = 0.15
    max_recompute_ratio: float = 1.0
    max_prefetch_bytes: int = 1 << 30  # chunk bytes being copied up at once by prefetch (0: off)
    throttle_bytes_per_s: dict[Tier, float] = field(default_factory=dict)  # simulated slow tiers (tests, bench)
    is_budgeted: bool = True  # the collection's KV budget (admission.py); False: every entry written, LRU evicts
    use_half_life: int = 10_000  # uses of the store after which a chunk's use count halves

    def __post_init__(self) -> None:
        if self.max_gpu_bytes < 0 or self.max_memory_bytes < 0 or self.max_disk_bytes < 0:
            raise ValueError("tier byte bounds must be >= 0")
        if self.max_gpu_bytes > 0:
            check_device(self.gpu_device)
        if self.engine_device_type not in ("cpu", "cuda"):
            raise ValueError(f"engine_device_type must be cpu or cuda, got {self.engine_device_type!r}")
        if self.prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if not 0.0 <= self.min_recompute_ratio <= self.max_recompute_ratio <= 1.0:
            raise ValueError(
                f"need 0 <= min_recompute_ratio ({self.min_recompute_ratio}) <= "
                f"max_recompute_ratio ({self.max_recompute_ratio}) <= 1"
            )
        if self.use_half_life < 1:
            raise ValueError(f"use_half_life must be >= 1, got {self.use_half_life}")
        if any(rate <= 0 for rate in self.throttle_bytes_per_s.values()):
            raise ValueError(f"throttles must be > 0 bytes/s, got {self.throttle_bytes_per_s}")

    @property
    def memory_format(self) -> StorageFormat:
        return StorageFormat(self.dtype)

    @property
    def remote_format(self) -> StorageFormat:
        """Format of the disk and Redis tiers (optionally int8)."""
        return StorageFormat(self.dtype, self.quantization)

    @classmethod
    def from_settings(cls, settings: Settings) -> StoreConfig:
        s = settings.store
        disk_dir = None
        if s.disk_enabled:
            disk_dir = Path(s.disk_dir if s.disk_dir is not None else settings.data_dir / "kv").expanduser()
        is_model_on_cuda = settings.model.device != "cpu" and torch.cuda.is_available()  # auto: CUDA when present
        max_gpu_bytes = s.max_gpu_bytes
        if max_gpu_bytes is None:  # a share of what the loaded model left free, where it runs on CUDA
            max_gpu_bytes = default_gpu_bytes(s.gpu_memory_share, s.gpu_device, is_model_on_cuda)
        return cls(
            max_gpu_bytes=max_gpu_bytes,
            gpu_device=s.gpu_device,
            max_memory_bytes=s.max_memory_bytes,
            disk_dir=disk_dir,
            max_disk_bytes=s.max_disk_bytes,
            redis_url=s.redis_url or None,
            redis_ttl_s=s.redis_ttl_s,
            dtype=s.dtype,
            quantization=s.quantization,
            write_tiers=frozenset(Tier(t) for t in s.write_tiers),
            fsync=s.fsync,
            is_pipelined=s.pipelined,
            prefetch_depth=s.prefetch_depth,
            loader_priority=s.loader_priority,
            engine_device_type="cuda" if is_model_on_cuda else "cpu",
            min_recompute_ratio=s.min_recompute_ratio,
            max_recompute_ratio=s.max_recompute_ratio,
            max_prefetch_bytes=s.max_prefetch_bytes,
            throttle_bytes_per_s={Tier(t): mbps * 1e6 for t, mbps in s.throttle_mbps.items()},
            is_budgeted=s.budgeted,
            use_half_life=s.use_half_life,
        )
