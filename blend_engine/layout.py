"""Reused KV laid into the fused cache: each used chunk's K/V copied straight into its slice, keys
re-positioned by RoPE in one op over the cached span, for all layers at once when every chunk is in
memory, else layer by layer as a streamed source delivers them."""

from __future__ import annotations

import torch

from blend_engine.kv import KVCache
from blend_engine.plan import PrefillPlan
from blend_engine.runner import apply_rope


def layout_all(cache: KVCache, plan: PrefillPlan, chunks: list[tuple[torch.Tensor, torch.Tensor]],
               cos: torch.Tensor, sin: torch.Tensor) -> None:
    """chunks: per cached segment, (K pre-RoPE, V) [L', H_kv, n, D] for layers first_reused_layer.. ."""
    first = plan.first_reused_layer
    _copy(cache.keys[first:], cache.values[first:], plan, chunks)
    _rotate(cache.keys[first:], plan, cos, sin)


def layout_layer(cache: KVCache, plan: PrefillPlan, layer: int, pairs: list[tuple[torch.Tensor, torch.Tensor]],
                 cos: torch.Tensor, sin: torch.Tensor) -> None:
    """pairs: one layer's (K pre-RoPE, V) [H_kv, n, D] per cached segment, as a LayerKVSource gives them."""
    pairs = [(k[None], v[None]) for k, v in pairs]  # each [1, H_kv, n, D]
    _copy(cache.keys[layer : layer + 1], cache.values[layer : layer + 1], plan, pairs)
    _rotate(cache.keys[layer : layer + 1], plan, cos, sin)


def _copy(keys: torch.Tensor, values: torch.Tensor, plan: PrefillPlan,
          pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """keys/values [L', H_kv, capacity, D] views of the cache; pairs for every cached segment."""
    if len(pairs) != len(plan.is_source_used):
        raise ValueError(f"KV source gave {len(pairs)} caches for {len(plan.is_source_used)} cached segments")
    used = [pair for pair, is_used in zip(pairs, plan.is_source_used) if is_used]
    for span, (k, v) in zip(plan.spans, used):
        if k.shape[-2] != span.num_tokens or v.shape[-2] != span.num_tokens:
            raise ValueError(f"KV source gave {k.shape[-2]} tokens for a segment of {span.num_tokens}")
        keys[:, :, span.start : span.end] = k
        values[:, :, span.start : span.end] = v


def _rotate(keys: torch.Tensor, plan: PrefillPlan, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate the cached span in place. Fresh slots inside it are rotated too (one op, not one per
    chunk): they hold garbage until the layer step overwrites them, before any attention reads them."""
    if not plan.spans:
        return
    start, end = plan.spans[0].start, plan.spans[-1].end
    span = keys[:, :, start:end]  # [L', H_kv, n, D]
    span.copy_(apply_rope(span, cos[start:end], sin[start:end]))
