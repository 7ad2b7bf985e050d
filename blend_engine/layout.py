"""Reused KV laid into the fused cache: each used chunk's keys rotated to their prompt positions and
written, with its values, straight into the chunk's slice of the cache (no concatenation, no
gather). Keys of chunks not computed at their place are scaled where the plan says
(`BlendConfig.reused_key_scale`). On CUDA, when every chunk is in memory, all layers at once before
the loop (a few large ops instead of launches per layer); on CPU, and for a streamed source, layer by
layer, where one layer's working set stays in the processor's caches (measured: the all-layers
layout was 2.5x slower on CPU)."""

from __future__ import annotations

import torch

from blend_engine.kv import KVCache
from blend_engine.layer import rotate_into
from blend_engine.plan import PrefillPlan

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


def layout_all(cache: KVCache, plan: PrefillPlan, chunks: Pairs, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """chunks: per cached segment, (K pre-RoPE, V) [L', H_kv, n, D] for layers first_reused_layer.. ."""
    first = plan.first_reused_layer
    _write(cache.keys[first:], cache.values[first:], plan, chunks, cos, sin_signed)
    scaled_from = max(first, plan.first_scaled_layer)
    for span in plan.spans:
        if plan.is_scaled(span, scaled_from):
            cache.keys[scaled_from:, :, span.start : span.end].mul_(plan.reused_key_scale)


def layout_layer(cache: KVCache, plan: PrefillPlan, layer: int, pairs: Pairs, cos: torch.Tensor,
                 sin_signed: torch.Tensor) -> None:
    """pairs: one layer's (K pre-RoPE, V) [H_kv, n, D] per cached segment, as a LayerKVSource gives them."""
    _write(cache.keys[layer], cache.values[layer], plan, pairs, cos, sin_signed)
    for span in plan.spans:
        if plan.is_scaled(span, layer):
            cache.keys[layer, :, span.start : span.end].mul_(plan.reused_key_scale)


def _write(keys: torch.Tensor, values: torch.Tensor, plan: PrefillPlan, pairs: Pairs, cos: torch.Tensor,
           sin_signed: torch.Tensor) -> None:
    """keys/values [..., H_kv, capacity, D] views of the cache; pairs for every cached segment, in order;
    cos, sin_signed [N, D] the prompt's RoPE tables (`RopeTable.signed_sin`)."""
    if len(pairs) != len(plan.is_source_used):
        raise ValueError(f"KV source gave {len(pairs)} caches for {len(plan.is_source_used)} cached segments")
    used = [pair for pair, is_used in zip(pairs, plan.is_source_used) if is_used]
    for span, (k, v) in zip(plan.spans, used):
        if k.shape[-2] != span.num_tokens or v.shape[-2] != span.num_tokens:
            raise ValueError(f"KV source gave {k.shape[-2]} tokens for a segment of {span.num_tokens}")
        k = k.to(keys.device, keys.dtype)  # a no-op when the chunk is already there
        rotate_into(keys[..., span.start : span.end, :], k, cos[span.start : span.end],
                    sin_signed[span.start : span.end])
        values[..., span.start : span.end, :] = v
