"""Prefill over [prefix, chunk_1 .. chunk_n, suffix] in one of four modes (see PrefillMode).

One loop serves every mode, in three parts a reader can follow: the host `PrefillPlan` (what is
reused, every count), the layer step (compute the active tokens against the fused cache) and, in
blend mode, the check step at each check layer (keep the fresh tokens plus the most deviating
cached ones). `full` keeps all tokens active; `prefix` and `reuse` only the tokens without a usable
cache; `blend` all tokens up to its first check layer. Reused KV is laid into the cache once per
request (all layers at once when it is in memory) and never gathered or concatenated per layer.
No value is read back from the device inside the loop: the selection is read once at the end.
`prefill_steps` can stop the loop after a group of layers and go on in a caller's next step (the
server's engine loop: running answers decode in between); `last_part` runs it to its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from blend_engine.active import (ActiveContext, ActiveSet, RopeTable, active_context, candidate_deviation, check_step,
                                 initial_active, last_token_shift)
from blend_engine.attention import AttentionBackend, attend, attend_heads, last_meta
from blend_engine.kv import ColumnBias, KVCache, LayerKVSource, WholeKVSource
from blend_engine.layout import layout_all, layout_layer
from blend_engine.plan import PrefillPlan
from blend_engine.prefill_graph import PrefillBucket, PrefillGraphs
from blend_engine.probe import probe_query_mass
from blend_engine.runner import ModelRunner, apply_rope
from blend_engine.timing import StageTimer, host_ms
from blend_engine.types import BlendConfig, PrefillResult, PrefillStats


@dataclass
class _Loop:
    """Per-request state the layer loop carries from one layer to the next."""

    hidden: torch.Tensor  # [A, hidden] hidden states of the active tokens
    active: ActiveSet
    selected: torch.Tensor | None = None  # [K] cached positions kept at the last check so far
    kv_wait_ms: float = 0.0  # host time blocked on a streamed source
    unselected_mass: torch.Tensor | None = None  # 0-d, from the first check
    is_guarded: bool = False
    last_shift: torch.Tensor | None = None  # 0-d, from the first check: a candidate guard signal
    probe_mass: torch.Tensor | None = None  # [N] the question's attention at the probe layer (query selections)
    laid_out: set[int] = field(default_factory=set)  # layers whose reused KV is in the cache (streamed layout)
    bucket: PrefillBucket | None = None  # past the last check, graphed: holds the hidden states instead of `hidden`

    @property
    def num_active(self) -> int:
        return self.bucket.num_tokens if self.bucket is not None else self.hidden.shape[0]


def last_part(parts: Generator[PrefillResult | None, None, None]) -> PrefillResult:
    """Run a `prefill_steps` generator to its end; its result."""
    try:
        for part in parts:
            if part is not None:
                return part
        raise RuntimeError("the prefill ended without a result")
    finally:
        parts.close()  # suspended at its last yield: finish it here, not when it is collected


def prefill_steps(runner: ModelRunner, plan: PrefillPlan, blend: BlendConfig, source: LayerKVSource | None,
                  max_new_tokens: int, backend: AttentionBackend, is_profiled: bool = False,
                  is_bulk_layout: bool = False, max_step_token_layers: int | None = None,
                  graphs: PrefillGraphs | None = None,
                  attention_dtype: torch.dtype | None = None) -> Generator[PrefillResult | None, None, None]:
    """The prefill cut by layers: None after each group of layers, then the PrefillResult.

    The step budget counts token-layers: each layer adds the tokens active at its start (all of them in
    full mode and up to blend's first check; the fresh and selected ones after its last). A part ends
    once the layers run since the last yield add up to `max_step_token_layers` (None: never cut), so a
    caller (the server's engine loop) can run other work between the parts; the generator goes on from
    the next layer when resumed, and the last layer is never followed by a yield (the result comes
    next). Once no check layer is left the rest of the work is known (its active tokens no longer
    change), and it is shared evenly: the fewest parts that keep within the budget, of equal work
    (`_part_target`), rather than full parts and a small last one. Every op runs as in one go, in the
    same order: the result is the same. `prefill_ms` counts the parts' own time, not the pauses
    between them. The caller owns `source` and closes it, also when it abandons the generator midway
    (`close()`). Attention computes in `attention_dtype` (None: the model's).

    With `graphs`, the layers past the last check layer (every layer where there is none) run their
    linear parts as a bucket's CUDA graphs (blend_engine/prefill_graph.py; off CUDA, the same static
    functions eagerly); a pause takes the hidden states out of the bucket and gives it back."""
    if max_step_token_layers is not None and max_step_token_layers < 1:
        raise ValueError(f"max_step_token_layers must be >= 1 or None, got {max_step_token_layers}")
    t_start = time.perf_counter()
    device, num_tokens = runner.device, plan.num_tokens
    timer = StageTimer(device, is_profiled)
    if plan.cached_pos and source is None:
        raise ValueError("segments carry caches but no KV source was given")
    capacity = -(-(num_tokens + max_new_tokens) // 16) * 16  # aligned rows for the decode step's masked attention
    cache = KVCache(runner.num_layers, runner.num_kv_heads, runner.head_dim, capacity, device, runner.dtype)
    cache.extend(num_tokens)
    rope = RopeTable(*runner.rope(torch.arange(num_tokens, device=device)))  # [N, D] each
    ctx = active_context(plan, rope, backend, runner.num_heads // runner.num_kv_heads, device,
                         attention_dtype or runner.dtype, blend, runner.scaling)
    is_whole = is_bulk_layout and isinstance(source, WholeKVSource)
    if plan.cached_pos and is_whole:
        with timer.stage("rope"):
            layout_all(cache, plan, source.layers_from(plan.first_reused_layer), rope.cos, rope.signed_sin)
    with timer.stage("compute"):
        active = initial_active(ctx)
        ids = torch.tensor(plan.token_ids, dtype=torch.long, device=device)  # [N]
        state = _Loop(runner.embed(ids if isinstance(active.slots, slice) else ids[active.pos]), active)

    def lay_out(layer: int) -> None:  # once per layer: the probe may need a layer before the loop does
        if plan.is_reused_at(layer) and not is_whole and layer not in state.laid_out:
            state.kv_wait_ms += _stream_layer(cache, plan, layer, source, rope, timer)
            state.laid_out.add(layer)

    num_step_token_layers = 0  # token-layers run since the last yield
    last_check = plan.check_layers[-1] if plan.check_layers else -1
    try:
        for layer in range(runner.num_layers):
            num_step_token_layers += state.num_active  # the tokens this layer computes
            lay_out(layer)
            if graphs is None or layer <= last_check or not _in_bucket(state, graphs, timer):
                _layer_step(runner, ctx, blend, cache, layer, state, timer, lay_out)
            else:
                _graphed_layer_step(runner, ctx, cache, layer, state, timer, graphs)
            if max_step_token_layers is None or layer == runner.num_layers - 1:
                continue
            # past the last check every later layer computes the same active tokens: the rest is known
            rest = state.num_active * (runner.num_layers - 1 - layer) if layer >= last_check else None
            if num_step_token_layers >= _part_target(max_step_token_layers, num_step_token_layers, rest):
                _leave_bucket(state, graphs)  # the bucket is free for others while this prefill waits
                t_pause = time.perf_counter()
                yield None
                t_start += time.perf_counter() - t_pause  # prefill_ms: the parts' own time, not the pauses
                num_step_token_layers = 0
    finally:
        _leave_bucket(state, graphs)  # also where the prefill failed or was abandoned midway
    with timer.stage("compute"):
        logits = runner.logits(state.hidden[-1:])[0]  # [vocab]
    if state.active.bias is not None:  # scoring and decoding attend to the reused tokens as the prefill did
        bias = F.pad(state.active.bias, (0, capacity - num_tokens)).to(cache.keys.dtype)  # decode: the cache's dtype
        cache.column_bias = ColumnBias(bias, plan.first_scaled_layer)
    selected, unselected, last_shift = _read_back(state)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # prefill_ms ends when the logits exist, not when they were queued
    stats = _stats(plan, blend, selected, timer, state.kv_wait_ms, t_start)
    stats.unselected_mass, stats.is_guarded, stats.last_token_shift = unselected, state.is_guarded, last_shift
    yield PrefillResult(token_ids=list(plan.token_ids), cache=cache, logits=logits, stats=stats)


def _part_target(budget: int, num_done: int, num_rest: int | None) -> float:
    """The token-layers at which the current part ends: the budget, or, where the rest of the prefill
    (`num_rest` token-layers after this layer) is known, an even share of the current part's work so far
    and the rest over the fewest parts that keep each within the budget."""
    if num_rest is None:
        return budget
    total = num_done + num_rest
    return total / -(-total // budget)


def _stream_layer(cache: KVCache, plan: PrefillPlan, layer: int, source: LayerKVSource, rope: RopeTable,
                  timer: StageTimer) -> float:
    """Lay out one layer of a streamed source; returns the host ms spent waiting for it."""
    t0 = time.perf_counter()
    pairs = source.layer(layer)  # blocks until the loader has this layer
    wait_ms = host_ms(t0)
    with timer.stage("rope"):
        layout_layer(cache, plan, layer, pairs, rope.cos, rope.signed_sin)
    return wait_ms


def _in_bucket(state: _Loop, graphs: PrefillGraphs, timer: StageTimer) -> bool:
    """Whether the active tokens are in a bucket (loaded into one here where they were not); False:
    none to be had (too many tokens, or the bucket in use), this layer runs eagerly."""
    if state.bucket is None:
        state.bucket = graphs.acquire(state.num_active)
        if state.bucket is None:
            return False
        with timer.stage("compute"):
            state.bucket.load(state.hidden, state.active.cos, state.active.signed_sin)
    return True


def _leave_bucket(state: _Loop, graphs: PrefillGraphs | None) -> None:
    """The hidden states out of the bucket (a copy), the bucket given back."""
    if state.bucket is not None:
        state.hidden = state.bucket.output().clone()
        graphs.release(state.bucket)
        state.bucket = None


def _graphed_layer_step(runner: ModelRunner, ctx: ActiveContext, cache: KVCache, layer: int, state: _Loop,
                        timer: StageTimer, graphs: PrefillGraphs) -> None:
    """`_layer_step` past the last check, its linear parts replayed from the bucket's graphs: left eager
    are the K/V write and the attention (the request's own shapes). At the last layer only the last
    token goes on (as there), and the bucket is given back."""
    plan, active, bucket = ctx.plan, state.active, state.bucket
    with timer.stage("compute"):
        q, k, v = bucket.qkv(layer)  # [H, A, D], [H_kv, A, D] x2; q, k rotated
        keys, values = cache.update(layer, active.slots, k, v)
        if layer < runner.num_layers - 1:
            meta = active.attention_at(layer, plan.first_scaled_layer)
            bucket.finish(layer, attend_heads(q, keys, values, meta, runner.scaling))
            return
        meta = last_meta(plan.num_tokens, active.bias_at(layer, plan.first_scaled_layer), ctx.dtype)
        out = attend(q[:, -1:], keys, values, meta, runner.scaling)  # [1, H*D]
        hidden = bucket.output()[-1:]
        graphs.release(bucket)
        state.bucket = None
        state.hidden = runner.finish(layer, hidden, out)


def _layer_step(runner: ModelRunner, ctx: ActiveContext, blend: BlendConfig, cache: KVCache, layer: int,
                state: _Loop, timer: StageTimer, lay_out: Callable[[int], None]) -> None:
    plan, active = ctx.plan, state.active
    is_check = layer in plan.check_layers
    with timer.stage("compute"):
        if is_check:  # the check ranks with q before RoPE
            q, k, v = runner.qkv(layer, state.hidden)  # [H, A, D], [H_kv, A, D] x2; q, k before RoPE
            k = apply_rope(k, active.cos, active.sin)
        else:
            q, k, v = runner.qkv(layer, state.hidden, active.rope)  # q, k rotated, in one pass
    if is_check:
        with timer.stage("select"):
            deviation = candidate_deviation(ctx, active, layer, k, v, cache)  # before the reused K/V go
            if blend.is_shift_measured and state.last_shift is None:
                state.last_shift = last_token_shift(ctx, active, layer, q, k, v, cache)
    with timer.stage("compute"):
        cache.update(layer, active.slots, k, v)
    rows = None
    if is_check:
        with timer.stage("select"):
            if plan.probe_layer is not None and state.probe_mass is None:
                state.probe_mass = probe_query_mass(runner, ctx, active, cache, layer, state.hidden, q, lay_out)
            check = check_step(ctx, active, plan.check_layers.index(layer), layer, deviation, q, cache,
                               state.probe_mass)
            new, rows = check.active, check.rows
            state.selected = new.pos[new.cand_rows]
            if check.unselected_mass is not None:
                state.unselected_mass, state.is_guarded = check.unselected_mass, check.is_guarded
    with timer.stage("compute"):
        hidden = state.hidden
        if rows is not None:
            q, hidden, active = q[:, rows], hidden[rows], new
            state.active = active
        cos, sin, meta = active.cos, active.sin, active.attention_at(layer, plan.first_scaled_layer)
        if layer == runner.num_layers - 1:  # only the last token's output matters now
            meta = last_meta(plan.num_tokens, active.bias_at(layer, plan.first_scaled_layer), ctx.dtype)
            q, hidden, cos, sin = q[:, -1:], hidden[-1:], cos[-1:], sin[-1:]
        if is_check:
            q = apply_rope(q, cos, sin)
        keys, values = cache.layer(layer)
        out = attend(q, keys, values, meta, runner.scaling)
        state.hidden = runner.finish(layer, hidden, out)


def _stats(plan: PrefillPlan, blend: BlendConfig, selected: list[int], timer: StageTimer, kv_wait_ms: float,
           t_start: float) -> PrefillStats:
    totals = timer.totals()
    num_reused = plan.num_cached - len(selected)
    return PrefillStats(
        mode=plan.mode,
        num_prompt_tokens=plan.num_tokens,
        num_cached_tokens=plan.num_cached,
        num_reused_tokens=num_reused,
        num_recomputed_tokens=plan.num_tokens - num_reused,
        kv_load_ms=kv_wait_ms,
        rope_ms=totals.get("rope", 0.0),
        select_ms=totals.get("select", 0.0),
        compute_ms=totals.get("compute", 0.0),
        prefill_ms=host_ms(t_start),
        recompute_ratio=_ratio_used(plan, blend, len(selected)),
        selected_positions=selected,
        is_timing_exact=timer.is_exact,
    )


def _read_back(state: _Loop) -> tuple[list[int], float | None, float | None]:
    """The selection and the guard signals, in one device-to-host read (float64 holds positions exactly)."""
    if state.selected is None:
        return [], None, None
    shift = state.last_shift if state.last_shift is not None else torch.full_like(state.unselected_mass, torch.nan)
    signals = [state.unselected_mass.double().reshape(1), shift.double().reshape(1)]
    values = torch.cat([state.selected.double(), *signals]).tolist()
    return [int(p) for p in values[:-2]], values[-2], (None if values[-1] != values[-1] else values[-1])


def _ratio_used(plan: PrefillPlan, blend: BlendConfig, num_selected: int) -> float | None:
    """The share of the reused tokens actually recomputed: what ran, not what was asked (a requested
    1e-320 keeps round(1e-320 * n) = 0 tokens, and says 0.0)."""
    if not plan.check_layers:
        return None
    if plan.num_cached == 0:
        return blend.recompute_ratio  # nothing to select from: the ratio had nothing to apply to
    return num_selected / plan.num_cached
