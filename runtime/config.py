"""The scheduler's configuration (owned here; `configs.settings.ServerSettings` feeds it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_queue: int = 16  # requests and jobs waiting; beyond: QueueFull (503 + Retry-After)
    retry_after_s: int = 2
    max_running: int = 8  # sequences decoding together (1: one request at a time, the old worker)
    max_running_kv_bytes: int = 4 << 30  # their caches' bytes; beyond, a request waits (one always runs)
    max_prefill_tokens: int = 4096  # prompt tokens admitted per step (at least one prefill always is)
    prefill_chunk_tokens: int = 512  # a long prefill runs one part (this many tokens' work) per step
    background_every_steps: int = 8  # while busy, a background unit once in this many steps (see Scheduler)
    # while prefills run, the running sequences' decode step is put off until the one longest without
    # a token would wait longer than this (0, the default: they decode every step; see Scheduler)
    max_decode_stall_ms: int = 0
    max_background: int = 64  # background units waiting; beyond, submit_background says no

    def __post_init__(self) -> None:
        for name in ("max_queue", "max_running", "max_prefill_tokens", "prefill_chunk_tokens",
                     "background_every_steps", "max_background", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_decode_stall_ms < 0:
            raise ValueError(f"max_decode_stall_ms must be >= 0, got {self.max_decode_stall_ms}")
        if self.max_running_kv_bytes < 1:
            raise ValueError(f"max_running_kv_bytes must be >= 1, got {self.max_running_kv_bytes}")
