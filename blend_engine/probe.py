"""A cheap probe for query-aware selection: the question's attention at a layer deeper than the check.

At blend's first check layer every token has just been computed fresh; the probe carries on with the
prompt's fresh tokens alone (the question, separators: a few dozen) through the layers up to
`PrefillPlan.probe_layer` (`BlendConfig.probe_layer`, or a shallower one within `probe_budget`), over the
reused cache, as `reuse` mode would, and returns the attention mass the question gives each position there.
The main loop then selects with it at the check layer as usual. The probe writes K/V only at fresh
positions, which the main loop recomputes (and overwrites) at every layer, so it leaves no trace in the
result. Nothing is read back to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blend_engine.active import ActiveContext, ActiveSet
from blend_engine.attention import attend, subset_meta
from blend_engine.kv import KVCache
from blend_engine.runner import ModelRunner, apply_rope
from blend_engine.selector import query_mass


def probe_query_mass(runner: ModelRunner, ctx: ActiveContext, active: ActiveSet, cache: KVCache, layer: int,
                     hidden: torch.Tensor, q: torch.Tensor, lay_out: Callable[[int], None]) -> torch.Tensor:
    """[N] attention mass the question gives each position at `ctx.plan.probe_layer` (summed over the
    `probe_span` layers ending there, none before the check layer's successor).

    `active` is the first check layer's set (every token), `layer` that layer, after the cache took
    its fresh K/V; hidden [A, hidden] its input, q [H, A, D] its queries (pre-RoPE). `lay_out(l)`
    makes sure layer l's reused KV is in the cache (the main loop then skips it).
    """
    plan, target = ctx.plan, ctx.plan.probe_layer
    rows = active.fresh_rows  # [F] the fresh tokens, the question last
    pos, cos, sin = active.pos[rows], active.cos[rows], active.sin[rows]
    meta = subset_meta(pos, plan.num_tokens, ctx.backend, ctx.num_query_groups, list(plan.fresh_pos), ctx.dtype)
    h, q = hidden[rows], q[:, rows]  # [F, hidden], [H, F, D]
    first_summed = max(layer + 1, target - ctx.blend.probe_span + 1)
    mass = torch.zeros(plan.num_tokens, device=ctx.device)  # [N]
    for probe_layer in range(layer, target + 1):
        if probe_layer > layer:
            lay_out(probe_layer)
            q, k, v = runner.qkv(probe_layer, h)
            cache.update(probe_layer, pos, apply_rope(k, cos, sin), v)
        if probe_layer >= first_summed:
            mass += _mass(ctx, cache, probe_layer, q, cos, sin)
        if probe_layer == target:
            return mass
        keys, values = cache.layer(probe_layer)
        h = runner.finish(probe_layer, h, attend(apply_rope(q, cos, sin), keys, values, meta, runner.scaling))
    return mass


def _mass(ctx: ActiveContext, cache: KVCache, layer: int, q: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor) -> torch.Tensor:
    """[N] the question's attention mass at `layer`; q [H, F, D] the fresh tokens' (pre-RoPE), question last."""
    num_query, num_tokens = ctx.plan.num_query_tokens, ctx.plan.num_tokens
    q_last = apply_rope(q[:, -num_query:], cos[-num_query:], sin[-num_query:])
    return query_mass(q_last, cache.keys[layer][:, :num_tokens], ctx.query_mask, ctx.scale, ctx.blend.query_heads,
                      ctx.blend.query_tokens)
