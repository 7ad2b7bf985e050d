"""The host-side plan of a prefill, fixed before the layer loop: which caches are used, where the
reused tokens sit, and every count the loop needs (so the loop never asks the device for one)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from blend_engine.types import BlendConfig, PrefillMode, Segment


@dataclass(frozen=True)
class CachedSpan:
    """A used cache's place in the prompt: its KV is written to slots start .. start+num_tokens-1."""

    start: int
    num_tokens: int
    is_exact: bool = False  # computed behind exactly the tokens that precede it here: its KV is a full prefill's

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class PrefillPlan:
    token_ids: tuple[int, ...]
    mode: PrefillMode
    is_source_used: tuple[bool, ...]  # per segment with a kv, in prompt order: is its cache used?
    spans: tuple[CachedSpan, ...]  # the used caches, in prompt order
    cached_pos: tuple[int, ...]  # positions whose reused KV is used, ascending (never the last token)
    fresh_pos: tuple[int, ...]  # every other position, ascending (always ends with the last token)
    check_layers: tuple[int, ...]  # blend's check layers (empty in other modes or with nothing cached)
    num_keep: tuple[int, ...]  # per check layer: cached tokens kept from there on
    first_reused_layer: int  # layers before it compute every token and read no reused KV
    forced_cached_idx: tuple[int, ...]  # indices into cached_pos always recomputed (chunk starts), if asked
    num_query_tokens: int  # the prompt's tail after the last cached chunk (the question): query-aware selection
    probe_layer: int | None  # where the question's attention is probed (query selections; None: at the check)
    reused_key_scale: float  # multiplies the reused keys of inexact chunks from `first_scaled_layer` on (1: none)
    first_scaled_layer: int
    reused_attention_scale: float  # multiplies their attention weights from `first_scaled_layer` on (1: none)

    @property
    def is_attention_scaled(self) -> bool:
        """Whether some reused tokens get a column bias (BlendConfig.reused_attention_scale)."""
        return self.reused_attention_scale != 1.0 and bool(self.scaled_attention_pos)

    @cached_property  # read twice per prefill: computed once
    def scaled_attention_pos(self) -> tuple[int, ...]:
        """The reused positions of inexact chunks, ascending: where the column bias goes (less the
        tokens blend recomputes)."""
        return tuple(p for s in self.spans if not s.is_exact for p in range(s.start, s.end) if p != self.num_tokens - 1)

    def is_scaled(self, span: CachedSpan, layer: int) -> bool:
        """Whether `span`'s reused keys at `layer` are laid out scaled (see BlendConfig.reused_key_scale)."""
        return self.reused_key_scale != 1.0 and not span.is_exact and layer >= self.first_scaled_layer

    @property
    def query_pos(self) -> tuple[int, ...]:
        return tuple(range(self.num_tokens - self.num_query_tokens, self.num_tokens))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cached(self) -> int:
        return len(self.cached_pos)

    @property
    def num_source_tokens(self) -> int:
        return sum(s.num_tokens for s in self.spans)

    def is_reused_at(self, layer: int) -> bool:
        """Whether this layer keeps reused KV for some tokens (so the source must deliver it)."""
        return bool(self.cached_pos) and layer >= self.first_reused_layer


def plan_prefill(segments: list[Segment], mode: PrefillMode, blend: BlendConfig, num_layers: int) -> PrefillPlan:
    token_ids, used, spans = _place(segments, mode)
    num_tokens = len(token_ids)
    if num_tokens == 0:
        raise ValueError("cannot prefill an empty prompt")
    is_cached = [False] * num_tokens
    for span in spans:
        is_cached[span.start : span.end] = [True] * span.num_tokens
    is_cached[-1] = False  # the last token is always computed: its hidden state gives the logits
    cached = tuple(p for p in range(num_tokens) if is_cached[p])
    fresh = tuple(p for p in range(num_tokens) if not is_cached[p])
    checks: tuple[int, ...] = ()
    if mode == PrefillMode.BLEND and cached:
        checks = blend.check_layers
        if checks[-1] >= num_layers:
            raise ValueError(f"check layer {checks[-1]} out of range for {num_layers} layers")
        if blend.probe_layer is not None and blend.probe_layer >= num_layers:
            raise ValueError(f"probe layer {blend.probe_layer} out of range for {num_layers} layers")
    keep = tuple(min(round(blend.ratio_at_check(j) * len(cached)), len(cached)) for j in range(len(checks)))
    # a later check can only keep a subset of what an earlier one kept
    keep = tuple(min(keep[: j + 1]) for j in range(len(keep)))
    first_reused = checks[0] if checks else (0 if cached else num_layers)
    forced = _chunk_starts(spans, cached, blend.chunk_start_tokens) if blend.selection.is_forcing_chunk_starts else ()
    num_query = max(1, num_tokens - (spans[-1].end if spans else 0))
    probe = _probe_layer(blend, len(fresh), keep[-1], num_layers) if checks and blend.selection.is_query else None
    # Blend and reuse alike scale from the layer after blend's last check: no deviation is measured there.
    first_scaled = blend.check_layers[-1] + 1
    return PrefillPlan(tuple(token_ids), mode, tuple(used), tuple(spans), cached, fresh, checks, keep, first_reused,
                       forced, num_query, probe, blend.reused_key_scale, first_scaled, blend.reused_attention_scale)


# A layer pass over fewer rows than this costs about as much as one over this many: the read of the layer's
# weights dominates (the 1.5B on a 2-core Xeon: 16 ms at 33 rows, 20 ms at 122, 92 ms at 626).
MIN_PASS_ROWS = 128


def _probe_layer(blend: BlendConfig, num_fresh: int, num_keep: int, num_layers: int) -> int | None:
    """`blend.probe_layer`, or a shallower layer where probing there would cost more than `probe_budget` of
    the blend's own layer passes: the probe passes the fresh tokens through a layer each, the blend the fresh
    and the `num_keep` recomputed tokens through every layer, each pass costing its rows, at least
    MIN_PASS_ROWS. None: no layer after the check is affordable."""
    if blend.probe_layer is None or blend.probe_budget is None:
        return blend.probe_layer
    first = blend.first_check_layer
    ratio = max(num_fresh + num_keep, MIN_PASS_ROWS) / max(num_fresh, MIN_PASS_ROWS)  # a blend pass / a probe pass
    layer = min(blend.probe_layer, first + int(blend.probe_budget * num_layers * ratio))
    return layer if layer > first else None


def _chunk_starts(spans: list[CachedSpan], cached: tuple[int, ...], num_first: int) -> tuple[int, ...]:
    """Indices into `cached` of each used chunk's first `num_first` tokens."""
    index = {p: i for i, p in enumerate(cached)}
    starts = (p for s in spans for p in range(s.start, min(s.end, s.start + num_first)))
    return tuple(index[p] for p in starts if p in index)


def _place(segments: list[Segment], mode: PrefillMode) -> tuple[list[int], list[bool], list[CachedSpan]]:
    token_ids: list[int] = []
    used: list[bool] = []
    spans: list[CachedSpan] = []
    is_prefix_intact = True
    for seg in segments:
        start = len(token_ids)
        token_ids.extend(seg.token_ids)
        if seg.kv is None:
            is_prefix_intact = is_prefix_intact and not seg.token_ids
            continue
        # Exact only if computed behind exactly the tokens that precede it here.
        is_exact = tuple(seg.kv.context_ids) == tuple(token_ids[:start])
        if mode == PrefillMode.FULL:
            is_used = False
        elif mode == PrefillMode.PREFIX:
            is_used = is_prefix_intact and is_exact
            is_prefix_intact = is_used
        else:
            is_used = True
        used.append(is_used)
        if is_used:
            spans.append(CachedSpan(start, len(seg.token_ids), is_exact))
    return token_ids, used, spans
