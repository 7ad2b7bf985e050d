"""The engine side of the loading planner: measure the engine's prefill cost at start-up, describe a
finished prefill in the cost model's terms, and report a plan with its predicted and actual figures."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence, TYPE_CHECKING

import torch

from blend_engine.types import BlendConfig, PrefillMode, PrefillStats, Segment
from kv_store.loader import StoredChunk
from kv_store.planner import LoadPlan, PrefillShape

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine


@dataclass(frozen=True)
class PlanReport:
    """What the planner chose for one answer, and what then happened (ms)."""

    plan: str  # full | blend | mixed | split
    recompute_ratio: float | None
    num_chunks_recomputed: int  # stored chunks computed as fresh tokens (mixed)
    predicted_load_ms: float
    predicted_compute_ms: float
    predicted_ttft_ms: float
    actual_load_ms: float  # reading the reused chunks' layers (overlapped with compute when pipelined)
    actual_prefill_ms: float

    @classmethod
    def of(cls, plan: LoadPlan, num_recomputed: int, load_s: float, stats: PrefillStats) -> PlanReport:
        return cls(plan.kind.value, plan.ratio, num_recomputed, round(plan.predicted_load_ms, 2),
                   round(plan.predicted_compute_ms, 2), round(plan.predicted_ttft_ms, 2), round(load_s * 1000, 2),
                   round(stats.prefill_ms, 2))


def planned_segments(segments: Sequence[Segment], plan: LoadPlan) -> list[Segment]:
    """The prompt as the plan runs it: the stored chunks it computes (by tier: mixed; by position:
    split) become fresh tokens, the others keep their store handle."""
    handles = [s.kv for s in segments if isinstance(s.kv, StoredChunk)]
    is_reused = iter(plan.reused_mask(handles))
    return [s if not isinstance(s.kv, StoredChunk) or next(is_reused) else Segment(s.token_ids) for s in segments]


def shape_of(stats: PrefillStats, num_layers: int, first_check_layer: int) -> PrefillShape:
    """A finished prefill in the cost model's terms (reuse reads every layer, blend from its check)."""
    if stats.mode is PrefillMode.FULL or stats.num_cached_tokens == 0:
        return PrefillShape(stats.num_prompt_tokens, stats.num_prompt_tokens, 0, 0.0)
    first = first_check_layer if stats.mode is PrefillMode.BLEND else 0
    fraction = max(num_layers - first, 0) / num_layers
    return PrefillShape(stats.num_prompt_tokens, stats.num_recomputed_tokens, stats.num_cached_tokens, fraction)


def compute_seconds(stats: PrefillStats) -> float:
    """The prefill's own work: its wall time less the time it waited on KV loads."""
    return max(stats.prefill_ms - stats.kv_load_ms, 0.0) / 1000


def measure_engine(engine: BlendEngine, sizes: Sequence[int], blend: BlendConfig) -> list[tuple[PrefillShape, float]]:
    """Timed prefills for the cost model: full at each size, reuse and blend at the largest (chunk KV
    in memory). Run once at start-up on the engine worker, never inside a user's request."""
    sizes = sorted({min(int(s), engine.max_context - 16) for s in sizes if s > 0})
    if not sizes:
        raise ValueError("the planner needs at least one profile size")
    vocab = int(engine.model.config.vocab_size)
    rng = torch.Generator().manual_seed(0)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, vocab, (n,), generator=rng).tolist())

    samples: list[tuple[PrefillShape, float]] = []

    def timed(segments: list[Segment], mode: PrefillMode) -> None:
        start = time.perf_counter()
        result = engine.prefill(segments, mode=mode, blend=blend)
        elapsed = time.perf_counter() - start
        samples.append((shape_of(result.stats, engine.num_layers, blend.first_check_layer), elapsed))

    engine.prefill([Segment(ids(sizes[0]))], mode=PrefillMode.FULL)  # warm-up (allocations, kernels)
    for n in sizes:
        timed([Segment(ids(n))], PrefillMode.FULL)
    chunk = ids(sizes[-1])
    cached = Segment(chunk, engine.precompute(chunk))
    question = Segment(ids(16))
    for mode in (PrefillMode.REUSE, PrefillMode.BLEND):
        timed([cached, question], mode)
    return samples
