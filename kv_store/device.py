"""GPU tier: the memory tier's byte-bounded LRU, its ChunkKVs held on a torch device.

Above the CPU memory tier: a chunk found there (or below) is copied up on a hit, and its layers are
then views on the engine's device, nothing to copy. The default size is a share of the free device
memory at start-up (the model's weights are loaded by then); off where CUDA is not. The device is a
parameter, so tests run the tier on "cpu".
"""

from __future__ import annotations

import torch

from blend_engine.kv import ChunkKV
from kv_store.backend import Tier
from kv_store.memory import MemoryBackend


class DeviceBackend(MemoryBackend):
    """Entries on `device` in the storage dtype; `get` returns the stored object (read-only)."""

    tier = Tier.GPU

    def __init__(self, max_bytes: int, dtype: torch.dtype, device: torch.device | str):
        super().__init__(max_bytes, dtype, is_pinned=False)
        self.device = torch.device(device)

    def _place(self, kv: ChunkKV) -> ChunkKV:
        # from a pinned memory-tier entry (CUDA hosts) this is one DMA at full PCIe speed
        return kv.to(self.device, self._dtype)


def check_device(device: str) -> torch.device:
    """The GPU tier's device, or ValueError when it cannot hold one (no CUDA, a missing GPU)."""
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"not a torch device: {device!r}") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"the GPU tier is set on {device} but CUDA is not available; set max_gpu_bytes to 0")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"the GPU tier is set on {device} but there are {torch.cuda.device_count()} GPUs")
    elif resolved.type != "cpu":
        raise ValueError(f"the GPU tier runs on cuda (or cpu, for tests), not {device!r}")
    return resolved


def default_gpu_bytes(share: float, device: str, is_model_on_cuda: bool) -> int:
    """`share` of the device's free memory now, or 0 (no tier) where the model is not on CUDA."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"the GPU tier's share of free memory must be in (0, 1), got {share}")
    if not is_model_on_cuda or not torch.cuda.is_available() or torch.device(device).type != "cuda":
        return 0
    free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free_bytes * share)
