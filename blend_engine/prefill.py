"""Prefill over [prefix, chunk_1 .. chunk_n, suffix] in one of four modes (see PrefillMode).

One loop serves every mode. Each layer computes an *active* set of tokens; every other token keeps
its reused KV (re-rotated to its absolute position). `full` keeps all tokens active; `prefix` and
`reuse` only the tokens without a usable cache; `blend` keeps all tokens active up to the first
check layer, then only the most deviating cached tokens plus every uncached one (CacheBlend).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blend_engine.kv import KVCache, LayerKVSource
from blend_engine.runner import ModelRunner, apply_rope
from blend_engine.selector import select_top, token_deviation
from blend_engine.types import BlendConfig, DeviationKind, PrefillMode, PrefillResult, PrefillStats, Segment


@dataclass(frozen=True)
class PrefillPlan:
    """Where the prompt's reused tokens are; fixed before the layer loop runs."""

    token_ids: tuple[int, ...]
    is_source_used: tuple[bool, ...]  # per segment with a kv, in prompt order: is its cache used?
    cached_pos: torch.Tensor  # [M] positions whose reused KV is used (ascending)
    num_source_tokens: int  # tokens delivered per layer by the used sources (M, or M+1 if the last was dropped)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def plan_prefill(segments: list[Segment], mode: PrefillMode, device: torch.device) -> PrefillPlan:
    token_ids: list[int] = []
    used: list[bool] = []
    cached: list[int] = []
    is_prefix_intact = True
    for seg in segments:
        start = len(token_ids)
        token_ids.extend(seg.token_ids)
        if seg.kv is None:
            is_prefix_intact = is_prefix_intact and not seg.token_ids
            continue
        if mode == PrefillMode.FULL:
            is_used = False
        elif mode == PrefillMode.PREFIX:
            # Exact only if computed behind exactly the tokens that precede it here.
            is_used = is_prefix_intact and tuple(seg.kv.context_ids) == tuple(token_ids[:start])
            is_prefix_intact = is_used
        else:
            is_used = True
        used.append(is_used)
        if is_used:
            cached.extend(range(start, len(token_ids)))
    num_source_tokens = len(cached)
    if cached and cached[-1] == len(token_ids) - 1:
        cached.pop()  # the last token is always computed: its hidden state gives the logits
    return PrefillPlan(
        token_ids=tuple(token_ids),
        is_source_used=tuple(used),
        cached_pos=torch.tensor(cached, dtype=torch.long, device=device),
        num_source_tokens=num_source_tokens,
    )


class _Timer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def add(self, stage: str, start: float) -> None:
        self.totals[stage] = self.totals.get(stage, 0.0) + (time.perf_counter() - start) * 1000


def run_prefill(
    runner: ModelRunner,
    plan: PrefillPlan,
    mode: PrefillMode,
    blend: BlendConfig,
    source: LayerKVSource | None,
    max_new_tokens: int,
) -> PrefillResult:
    t_start = time.perf_counter()
    timer = _Timer()
    device, num_tokens = runner.device, plan.num_tokens
    if num_tokens == 0:
        raise ValueError("cannot prefill an empty prompt")
    ids = torch.tensor(plan.token_ids, dtype=torch.long, device=device)  # [N]
    cos, sin = runner.rope(torch.arange(num_tokens, device=device))  # [N, D]
    cache = KVCache(runner.num_layers, runner.num_kv_heads, runner.head_dim, num_tokens + max_new_tokens,
                    device, runner.dtype)
    cache.extend(num_tokens)

    cached_pos = plan.cached_pos
    num_cached = cached_pos.numel()
    is_cached = torch.zeros(num_tokens, dtype=torch.bool, device=device)
    is_cached[cached_pos] = True
    check_layers = blend.check_layers if (mode == PrefillMode.BLEND and num_cached) else ()
    if check_layers and check_layers[-1] >= runner.num_layers:
        raise ValueError(f"check layer {check_layers[-1]} out of range for {runner.num_layers} layers")
    # Tokens computed at the current layer (ascending positions).
    active = torch.arange(num_tokens, device=device) if (check_layers or not num_cached) else (~is_cached).nonzero()[:, 0]
    stats = PrefillStats(mode=mode, num_prompt_tokens=num_tokens, num_cached_tokens=num_cached)
    hidden = runner.embed(ids[active])  # [A, hidden]

    for layer in range(runner.num_layers):
        t0 = time.perf_counter()
        q, k, v = runner.qkv(layer, hidden)  # [H, A, D], [H_kv, A, D] x2
        timer.add("compute", t0)
        is_check = layer in check_layers
        num_cached_active = int(is_cached[active].sum())
        keep_rows = None
        if num_cached and (is_check or num_cached_active < num_cached):
            t0 = time.perf_counter()
            reused_k, reused_v = _reused_layer(source, plan, layer)  # [H_kv, M, D] pre-RoPE
            timer.add("kv_load", t0)
            if is_check:
                t0 = time.perf_counter()
                keep_rows = _select(blend, check_layers.index(layer), active, is_cached, cached_pos,
                                    k, v, reused_k, reused_v, num_cached)
                kept = active[keep_rows]
                stats.selected_positions = kept[is_cached[kept]].tolist()
                timer.add("select", t0)
            t0 = time.perf_counter()
            cache.update(layer, cached_pos, apply_rope(reused_k, cos[cached_pos], sin[cached_pos]), reused_v)
            timer.add("rope", t0)
        t0 = time.perf_counter()
        cache.update(layer, active, apply_rope(k, cos[active], sin[active]), v)
        if layer == runner.num_layers - 1:  # only the last token's output matters now
            keep_rows = (keep_rows if keep_rows is not None else torch.arange(active.numel(), device=device))[-1:]
        if keep_rows is not None:
            q, hidden, active = q[:, keep_rows], hidden[keep_rows], active[keep_rows]
        keys, values = cache.layer(layer)
        is_plain_causal = active.numel() == num_tokens
        out = runner.attend(apply_rope(q, cos[active], sin[active]), keys, values,
                            None if is_plain_causal else active)
        hidden = runner.finish(layer, hidden, out)
        timer.add("compute", t0)

    t0 = time.perf_counter()
    logits = runner.logits(hidden[-1:])[0]  # [vocab]
    timer.add("compute", t0)
    _fill_stats(stats, blend, check_layers, num_tokens, num_cached, timer, t_start)
    return PrefillResult(token_ids=list(plan.token_ids), cache=cache, logits=logits, stats=stats)


def _reused_layer(source: LayerKVSource | None, plan: PrefillPlan, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The used sources' layer KV, concatenated in position order: [H_kv, M, D] each."""
    if source is None:
        raise ValueError("segments carry caches but no KV source was given")
    pairs = source.layer(layer)
    if len(pairs) != len(plan.is_source_used):
        raise ValueError(f"KV source gave {len(pairs)} caches for {len(plan.is_source_used)} cached segments")
    used = [pair for pair, is_used in zip(pairs, plan.is_source_used) if is_used]
    keys = torch.cat([k for k, _ in used], dim=1)
    values = torch.cat([v for _, v in used], dim=1)
    if keys.shape[1] != plan.num_source_tokens:
        raise ValueError(f"KV source gave {keys.shape[1]} tokens, expected {plan.num_source_tokens}")
    num_cached = plan.cached_pos.numel()  # drops the last token if the prompt ends in a cached chunk
    return keys[:, :num_cached], values[:, :num_cached]


def _select(blend, check_idx, active, is_cached, cached_pos, k, v, reused_k, reused_v, num_cached) -> torch.Tensor:
    """Rows of `active` kept after this check: every uncached token plus the top deviating cached ones."""
    cand_rows = is_cached[active].nonzero()[:, 0]  # rows of active that hold cached tokens
    cand_idx = torch.searchsorted(cached_pos, active[cand_rows])  # their index into the reused tensors
    fresh, reused = (k, reused_k) if blend.deviation == DeviationKind.KEY else (v, reused_v)
    deviation = token_deviation(fresh[:, cand_rows], reused[:, cand_idx].to(fresh.dtype))  # [num_cand]
    num_keep = min(round(blend.ratio_at_check(check_idx) * num_cached), cand_rows.numel())
    kept = cand_rows[select_top(deviation, num_keep)]
    uncached_rows = (~is_cached[active]).nonzero()[:, 0]
    return torch.cat([uncached_rows, kept]).sort().values


def _fill_stats(stats, blend, check_layers, num_tokens, num_cached, timer, t_start) -> None:
    num_selected = len(stats.selected_positions)
    if check_layers:
        stats.recompute_ratio = blend.recompute_ratio
    stats.num_reused_tokens = num_cached - num_selected
    stats.num_recomputed_tokens = num_tokens - stats.num_reused_tokens
    stats.kv_load_ms = timer.totals.get("kv_load", 0.0)
    stats.rope_ms = timer.totals.get("rope", 0.0)
    stats.select_ms = timer.totals.get("select", 0.0)
    stats.compute_ms = timer.totals.get("compute", 0.0)
    stats.prefill_ms = (time.perf_counter() - t_start) * 1000
