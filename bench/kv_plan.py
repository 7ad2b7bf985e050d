"""The loading planner in `ragblend bench kv`: fit each store's cost model on the engine, then run a
prefill the way the server's `mode: auto` does (full, blend, mixed or split, as planned)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from runtime.planning import measure_engine
from blend_engine.types import BlendConfig, PrefillMode, PrefillResult, Segment
from kv_store import KVStore
from kv_store.loader import StoredChunk, handles_in
from kv_store.planner import LoadPlan, PlanKind, PlanRequest

PromptFn = Callable[[Sequence[object]], list[Segment]]  # per-chunk caches (or None) -> prompt segments


def fit_planners(engine, stores: dict[str, KVStore], blend: BlendConfig, sizes: Sequence[int]) -> None:
    """One set of timed prefills, observed by every store's planner (they share the engine)."""
    samples = measure_engine(engine, sizes, blend)
    for store in stores.values():
        for shape, seconds in samples:
            store.planner.observe(shape, seconds)


def planned_prefill(engine, store: KVStore, handles: list[StoredChunk], prompt: PromptFn, blend: BlendConfig,
                    start_layer: int, is_pipelined: bool) -> tuple[PrefillResult, LoadPlan]:
    segments = prompt(handles)
    num_fresh = sum(len(s.token_ids) for s in segments) - sum(h.num_tokens for h in handles)
    request = PlanRequest(handles, sum(len(s.token_ids) for s in segments), num_fresh, start_layer,
                          engine.num_layers, is_pipelined)
    plan = store.plan(request)
    if plan.kind is PlanKind.FULL:
        return engine.prefill(prompt([None] * len(handles)), mode=PrefillMode.FULL), plan
    used = [h if is_reused else None for h, is_reused in zip(handles, plan.reused_mask(handles))]
    segments = prompt(used)
    source = store.layer_source(handles_in(segments), engine.device, engine.dtype, is_pipelined,
                                start_layer, engine.precompute)
    try:
        return engine.prefill(segments, blend=replace(blend, recompute_ratio=plan.ratio), kv_source=source), plan
    finally:
        source.close()
