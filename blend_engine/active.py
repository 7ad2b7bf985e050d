"""The set of tokens a prefill computes at its current layers, and blend's check step that shrinks it.

An `ActiveSet` is built before the layer loop (from the host plan) and again at each check layer
(on the device, from the selection), never per layer: its positions, the rows the next check picks
from, the RoPE rows and the attention metadata are then reused by every layer until the next check.
Nothing here reads a value back from the device, except the GROUPED attention backend's cut-offs
(CPU only, where there is no device to wait for).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

from blend_engine.attention import (AttentionBackend, AttentionMeta, additive_causal_mask, attend, causal_meta, last_meta,
                                    subset_meta)
from blend_engine.kv import KVCache
from blend_engine.plan import PrefillPlan
from blend_engine.runner import apply_rope, signed_sin
from blend_engine.selector import combine_scores, query_mass, select_top, token_deviation
from blend_engine.types import BlendConfig, DeviationKind


@dataclass(frozen=True)
class RopeTable:
    cos: torch.Tensor  # [N, D] for positions 0..N-1
    sin: torch.Tensor  # [N, D]

    @cached_property  # the prefill's: made once per request
    def signed_sin(self) -> torch.Tensor:
        """[N, D] sin with its first half negated: the table `LayerCalls.qkv` rotates by."""
        return signed_sin(self.sin)


@dataclass(frozen=True)
class ActiveSet:
    pos: torch.Tensor  # [A] absolute positions, ascending
    fresh_rows: torch.Tensor  # [F] rows of `pos` without a cache (always computed)
    cand_rows: torch.Tensor  # [C] rows of `pos` with a cache: what the next check may drop
    cos: torch.Tensor  # [A, D] RoPE rows for `pos`
    sin: torch.Tensor  # [A, D]
    signed_sin: torch.Tensor  # [A, D] `sin` with its first half negated (`rotate`'s table)
    attention: AttentionMeta
    slots: torch.Tensor | slice  # where the layer's fresh K/V go in the cache (a slice when all tokens)
    # From plan.first_scaled_layer on, with a reused attention scale: the column bias over every position
    # [N] (log scale at the reused tokens of inexact chunks not recomputed, else 0) and `attention` with it.
    bias: torch.Tensor | None = None
    biased_attention: AttentionMeta | None = None

    def attention_at(self, layer: int, first_scaled_layer: int) -> AttentionMeta:
        return self.biased_attention if self.biased_attention is not None and layer >= first_scaled_layer \
            else self.attention

    def bias_at(self, layer: int, first_scaled_layer: int) -> torch.Tensor | None:
        return self.bias if layer >= first_scaled_layer else None

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [A, D]: what `LayerCalls.qkv` rotates q and k by, in one pass."""
        return self.cos, self.signed_sin

    @property
    def num_tokens(self) -> int:
        return self.pos.shape[0]


@dataclass(frozen=True)
class ActiveContext:
    """What building an active set needs: fixed for the whole prefill."""

    plan: PrefillPlan
    rope: RopeTable
    backend: AttentionBackend
    num_query_groups: int  # query heads per KV head
    device: torch.device
    dtype: torch.dtype  # what the attention computes in, its additive masks too (ModelConfig.attention_dtype)
    blend: BlendConfig
    scale: float  # the model's attention scaling
    cached_pos: torch.Tensor  # [M] plan.cached_pos on the device
    is_forced: torch.Tensor  # [M] bool: always recomputed (chunk starts)
    query_mask: torch.Tensor | None  # [G*S, N] additive causal mask of the question's tokens (query selection)
    column_bias: torch.Tensor | None  # [N] in `dtype`: log reused_attention_scale where the plan scales, else 0


def active_context(plan: PrefillPlan, rope: RopeTable, backend: AttentionBackend, num_query_groups: int,
                   device: torch.device, dtype: torch.dtype, blend: BlendConfig, scale: float) -> ActiveContext:
    is_forced = torch.zeros(plan.num_cached, dtype=torch.bool, device=device)
    is_forced[list(plan.forced_cached_idx)] = True
    query_mask = None
    if blend.selection.is_query and plan.check_layers:
        query_mask = additive_causal_mask(_tensor(plan.query_pos, device), plan.num_tokens, num_query_groups,
                                          torch.float32)
    column_bias = None
    if plan.is_attention_scaled:
        column_bias = torch.zeros(plan.num_tokens, dtype=dtype, device=device)
        column_bias[list(plan.scaled_attention_pos)] = math.log(plan.reused_attention_scale)
    return ActiveContext(plan, rope, backend, num_query_groups, device, dtype, blend, scale,
                         _tensor(plan.cached_pos, device), is_forced, query_mask, column_bias)


def initial_active(ctx: ActiveContext) -> ActiveSet:
    """Every token until the first check (blend, full), else only the tokens without a cache."""
    plan, device = ctx.plan, ctx.device
    num_tokens = plan.num_tokens
    if plan.check_layers or not plan.cached_pos:
        pos = torch.arange(num_tokens, device=device)
        return ActiveSet(pos, _tensor(plan.fresh_pos, device), _tensor(plan.cached_pos, device), ctx.rope.cos,
                         ctx.rope.sin, ctx.rope.signed_sin, causal_meta(num_tokens, ctx.dtype), slice(0, num_tokens))
    pos = _tensor(plan.fresh_pos, device)
    rows = torch.arange(len(plan.fresh_pos), device=device)
    meta, biased = _metas(ctx, pos, list(plan.fresh_pos), ctx.column_bias)  # reuse: every reused token biased
    return ActiveSet(pos, rows, rows[:0], ctx.rope.cos[pos], ctx.rope.sin[pos], ctx.rope.signed_sin[pos], meta, pos,
                     ctx.column_bias, biased)


def candidate_deviation(ctx: ActiveContext, active: ActiveSet, layer: int, k: torch.Tensor, v: torch.Tensor,
                        cache: KVCache) -> torch.Tensor | None:
    """[C] fresh-vs-reused distance of the candidates, None when the selection does not use it.

    k (rotated), v [H_kv, A, D]: this layer's fresh K/V for `active`; call before they overwrite the
    reused (rotated) K/V the cache holds at the candidates' slots.
    """
    if not ctx.blend.selection.is_deviation:
        return None
    cand_pos = active.pos[active.cand_rows]  # [C]
    fresh, stored = (k, cache.keys) if ctx.blend.deviation == DeviationKind.KEY else (v, cache.values)
    return token_deviation(fresh[:, active.cand_rows], stored[layer][:, cand_pos])


def last_token_shift(ctx: ActiveContext, active: ActiveSet, layer: int, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """0-d: how far the reused K/V move the last token's attention output at the first check layer
    (relative L2, fused cache vs all fresh), a candidate quality-guard signal.

    Every token is active at the first check, so k (rotated), v [H_kv, N, D] are in position order;
    call before they overwrite the reused K/V in the cache. One query over N keys, twice: cheap.
    """
    num_tokens = ctx.plan.num_tokens
    is_cached = torch.zeros(num_tokens, dtype=torch.bool, device=ctx.device).index_fill_(0, ctx.cached_pos, True)
    keys = torch.where(is_cached[None, :, None], cache.keys[layer][:, :num_tokens], k)  # [H_kv, N, D]
    values = torch.where(is_cached[None, :, None], cache.values[layer][:, :num_tokens], v)
    q_last = apply_rope(q[:, -1:], active.cos[-1:], active.sin[-1:])
    meta = last_meta(num_tokens, dtype=ctx.dtype)
    fresh = attend(q_last, k, v, meta, ctx.scale)  # [1, H*D]
    fused = attend(q_last, keys, values, meta, ctx.scale)
    return (fused - fresh).float().norm() / fresh.float().norm().clamp_min(1e-30)


def check_step(ctx: ActiveContext, active: ActiveSet, check_idx: int, layer: int, deviation: torch.Tensor | None,
               q: torch.Tensor, cache: KVCache, probe_mass: torch.Tensor | None = None) -> CheckResult:
    """Keep every fresh token plus the best-ranked cached ones (by `ctx.selection`).

    q [H, A, D] (pre-RoPE): this layer's queries for `active`; the cache holds this layer's fused K
    (fresh for `active`, reused elsewhere). Returns the new set and the rows of `active` it keeps
    (ascending), to cut the queries and hidden states with. `probe_mass` [N]: the question's attention
    measured deeper by the probe (query selections), used instead of this layer's. Nothing is read back to the host, unless
    the config decides the ratio at the check (adaptive, guard): then one count, once per request.
    """
    cand_pos = active.pos[active.cand_rows]  # [C]
    raw, score = _score(ctx, active, deviation, q, cache.keys[layer], cand_pos, probe_mass)  # [C] each
    num_keep, unselected, is_guarded = ctx.plan.num_keep[check_idx], None, False
    if check_idx == 0:
        num_keep, unselected, is_guarded = decide_keep(ctx, raw, num_keep)
    if ctx.blend.selected_positions is None:
        kept_rows = active.cand_rows[select_top(score, num_keep)]  # [K] ascending
    else:  # given: the candidates at those positions (cand_rows ascending, so kept_rows is too)
        given = torch.tensor(ctx.blend.selected_positions, dtype=cand_pos.dtype, device=cand_pos.device)
        kept_rows = active.cand_rows[torch.isin(cand_pos, given)]
    rows = torch.cat([active.fresh_rows, kept_rows]).sort().values  # [F+K]; ascending rows = ascending positions
    pos = active.pos[rows]
    bias = None
    if ctx.column_bias is not None and check_idx == len(ctx.plan.check_layers) - 1:  # scaling starts after it
        bias = ctx.column_bias.index_fill(0, active.pos[kept_rows], 0.0)  # [N]: recomputed tokens unbiased
    host = pos.tolist() if ctx.backend == AttentionBackend.GROUPED else None  # read once for both metas
    meta, biased = _metas(ctx, pos, host, bias)
    new = ActiveSet(pos, torch.searchsorted(rows, active.fresh_rows), torch.searchsorted(rows, kept_rows),
                    active.cos[rows], active.sin[rows], active.signed_sin[rows], meta, pos, bias, biased)
    return CheckResult(new, rows, unselected, is_guarded)


@dataclass(frozen=True)
class CheckResult:
    active: ActiveSet  # the tokens computed from here on
    rows: torch.Tensor  # [A'] rows of the previous set kept (ascending)
    unselected_mass: torch.Tensor | None  # 0-d: share of the raw score left out (first check only)
    is_guarded: bool  # the quality guard raised the kept count


def decide_keep(ctx: ActiveContext, raw: torch.Tensor, num_keep: int) -> tuple[int, torch.Tensor, bool]:
    """The first check's kept count: the plan's, or adaptive / guarded (one host read, only then).

    Returns (kept count, share of the raw score left unselected [0-d, on the device], is_guarded).
    """
    num_cand = raw.shape[0]
    if num_cand == 0:
        return num_keep, raw.new_zeros(()), False
    covered = raw.sort(descending=True).values.cumsum(0) / raw.sum().clamp_min(1e-30)  # [C] ascending
    blend, is_guarded = ctx.blend, False
    if blend.is_ratio_adaptive:
        needed = int(torch.searchsorted(covered, covered.new_tensor(blend.adaptive_mass))) + 1
        # the bounds hold exactly: the upper one rounded down (it is applied last)
        num_keep = min(max(needed, round(blend.adaptive_min_ratio * num_cand)), math.floor(blend.adaptive_max_ratio * num_cand), num_cand)
    if blend.guard_unselected_mass is not None and num_keep < num_cand:
        left = 1.0 - float(covered[num_keep - 1]) if num_keep else 1.0
        if left > blend.guard_unselected_mass:
            num_keep, is_guarded = max(num_keep, min(round(blend.guard_ratio * num_cand), num_cand)), True
    unselected = 1.0 - covered[num_keep - 1] if num_keep else covered.new_ones(())
    return num_keep, unselected, is_guarded


def _score(ctx: ActiveContext, active: ActiveSet, deviation: torch.Tensor | None, q: torch.Tensor,
           keys: torch.Tensor, cand_pos: torch.Tensor,
           probe_mass: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[C] raw score of the candidates (all >= 0) and the ranking score (chunk starts above every other)."""
    score = deviation
    if ctx.blend.selection.is_query:
        mass = (probe_mass if probe_mass is not None else _check_mass(ctx, active, q, keys))[cand_pos]
        score = mass if deviation is None else combine_scores(mass, deviation, ctx.blend.combine)
    raw = score
    if ctx.plan.forced_cached_idx and cand_pos.numel():
        is_forced = ctx.is_forced[torch.searchsorted(ctx.cached_pos, cand_pos)]  # [C]
        score = score + is_forced * (score.max() + 1)  # stays on the device: no read-back
    return raw, score


def _check_mass(ctx: ActiveContext, active: ActiveSet, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[N] the question's attention mass over every position at the check layer itself."""
    num_query = ctx.plan.num_query_tokens  # the question: always the last rows of an active set
    q_last = apply_rope(q[:, -num_query:], active.cos[-num_query:], active.sin[-num_query:])
    return query_mass(q_last, keys[:, : ctx.plan.num_tokens], ctx.query_mask, ctx.scale, ctx.blend.query_heads,
                      ctx.blend.query_tokens)


def _metas(ctx: ActiveContext, pos: torch.Tensor, host: list[int] | None,
           bias: torch.Tensor | None) -> tuple[AttentionMeta, AttentionMeta | None]:
    """The attention metadata of queries at `pos` [A], and with the column `bias` [N] when there is one."""
    plan = ctx.plan
    meta = subset_meta(pos, plan.num_tokens, ctx.backend, ctx.num_query_groups, host, ctx.dtype)
    if bias is None:
        return meta, None
    return meta, subset_meta(pos, plan.num_tokens, ctx.backend, ctx.num_query_groups, host, ctx.dtype, bias)


def _tensor(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
