"""The scheduler's frozen configuration (the settings' `scheduler` section): the one place its defaults live."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass


@dataclass(frozen=True, config=ConfigDict(extra="forbid", validate_default=True))
class SchedulerConfig:
    max_queue: Annotated[int, Field(
        ge=1, le=4096, description="Requests waiting for the engine (and, apart, writes waiting for the one in "
        "progress) beyond this answer 503.")] = 16
    retry_after_s: Annotated[int, Field(ge=1, le=3600, description="Retry-After of a 503 when a queue is full.")] = 2
    max_running: Annotated[int, Field(
        ge=1, le=256, description="Answers decoding together in one batch (1: one request at a time); beyond, "
        "requests wait in the queue (docs/design/server.md).")] = 8
    max_running_kv_bytes: Annotated[int, Field(
        ge=1 << 20, description="Bytes the running answers' KV caches may hold together; beyond, a request "
        "waits (one always runs, whatever its size).")] = 4 << 30
    max_prefill_tokens: Annotated[int, Field(
        ge=1, description="Prompt tokens admitted per scheduler step (one prefill always is, whatever its "
        "size).")] = 4096
    prefill_chunk_tokens: Annotated[int, Field(
        ge=16, description="A long prefill runs in parts, one per scheduler step, so running answers keep "
        "streaming between them: a full prefill longer than this in chunks of this many tokens; any other "
        "(blend, reuse, prefix) in groups of layers whose active tokens add up to this x the model's layers, "
        "the work of one such chunk (docs/design/server.md).")] = 512
    max_decode_stall_ms: Annotated[int, Field(
        ge=0, le=600_000, description="While prefills run, the running answers' decode step is put off until "
        "one of them would go longer than this without a token, so queued prefills (at most max_running) run "
        "back to back: fuller decode batches, for a running answer's pause of about this long. 0 (the default): "
        "the running answers decode after every step. Measured in docs/decisions/0016.")] = 0
    background_every_steps: Annotated[int, Field(
        ge=1, description="Background work (KV repair, backfill, an ingest's precompute) runs when nothing "
        "waits; while busy, once in this many busy steps, and never a second unit before a waiting request's "
        "first token (a question's TTFT grows by one chunk's precompute at most).")] = 8
    max_background: Annotated[int, Field(
        ge=1, description="Background units waiting (KV repairs, backfill); beyond, new ones are dropped "
        "(a repair is scheduled again by the next question that misses the entry).")] = 64
    idle_release_s: Annotated[float, Field(
        ge=0, description="Once the engine has been idle this long after work, the memory the allocator holds "
        "free goes back to the system (glibc's malloc_trim): an idle server's RSS falls by a few hundred MB, and "
        "the first request after the pause touches those pages afresh (~20 000 page faults, ~0.1 s on a VM). "
        "0: never. Measured in docs/benchmarks/memory.md.")] = 30.0
