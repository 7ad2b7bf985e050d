"""Fused prefill against a full prefill: equivalence at r=1, exact prefixes, selection, masking."""

import itertools

import pytest
import torch

from blend_engine.attention import (MAX_QUERY_GROUPS, QUERY_BLOCK_ROWS, AttentionBackend, attend, causal_mask,
                                   query_group_bounds, subset_meta)
from blend_engine.runner import ModelRunner
from blend_engine.selector import select_top, token_deviation
from blend_engine.types import BlendConfig, DeviationKind, PrefillMode, Segment
from engine_models import cpu_exact, tol, MODEL_BUILDERS, build_engine, random_ids

FAMILIES = list(MODEL_BUILDERS)


def rag_prompt(engine, num_chunks=3, chunk_len=20, seed=10):
    """[prefix, chunk, sep, chunk, sep, chunk, question]: chunks cached, the rest fresh."""
    segments = [Segment(random_ids(6, seed))]
    for i in range(num_chunks):
        if i:
            segments.append(Segment(random_ids(2, seed + 100 + i)))
        ids = random_ids(chunk_len, seed + i + 1)
        segments.append(Segment(ids, engine.precompute(ids)))
    segments.append(Segment(random_ids(8, seed + 50)))
    return segments


def assert_same_prefill(a, b, atol=1e-4):
    n = len(a.token_ids)
    torch.testing.assert_close(a.logits, b.logits, **tol(atol))
    torch.testing.assert_close(a.cache.keys[:, :, :n], b.cache.keys[:, :, :n], **tol(atol))
    torch.testing.assert_close(a.cache.values[:, :, :n], b.cache.values[:, :, :n], **tol(atol))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("check_layers", [(1,), (0,), (1, 2, 3)])
def test_blend_at_ratio_one_equals_full_prefill(family, check_layers):
    engine = build_engine(family)
    segments = rag_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    blend = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=1.0, check_layers=check_layers))
    assert_same_prefill(blend, full)
    assert blend.stats.num_reused_tokens == 0
    assert blend.stats.num_recomputed_tokens == len(full.token_ids)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", [PrefillMode.PREFIX, PrefillMode.REUSE])
def test_one_chunk_at_position_zero_equals_full(family, mode):
    engine = build_engine(family)
    chunk, question = random_ids(30, seed=20), random_ids(7, seed=21)
    segments = [Segment(chunk, engine.precompute(chunk)), Segment(question)]
    result = engine.prefill(segments, mode)
    assert_same_prefill(result, engine.prefill(segments, PrefillMode.FULL))
    assert result.stats.num_reused_tokens == len(chunk)


def test_prefix_mode_stops_at_first_inexact_cache():
    engine = build_engine("llama-gqa")
    a, b = random_ids(10, seed=30), random_ids(10, seed=31)
    segments = [Segment(a, engine.precompute(a)), Segment(b, engine.precompute(b)), Segment(random_ids(4, 32))]
    result = engine.prefill(segments, PrefillMode.PREFIX)
    assert result.stats.num_reused_tokens == len(a)  # b was computed alone, not behind a
    assert_same_prefill(result, engine.prefill(segments, PrefillMode.FULL))
    # computed behind exactly what precedes it, b is exact too
    exact = [segments[0], Segment(b, engine.precompute(b, context_ids=a)), segments[2]]
    assert engine.prefill(exact, PrefillMode.PREFIX).stats.num_reused_tokens == len(a) + len(b)


@cpu_exact
@pytest.mark.parametrize("deviation", list(DeviationKind))
@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.3])
def test_selector_picks_exactly_top_ratio_by_deviation(deviation, ratio):
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=25)
    check = 2
    full = engine.prefill(segments, PrefillMode.FULL)
    blend = engine.prefill(segments, PrefillMode.BLEND,
                           BlendConfig.cacheblend(recompute_ratio=ratio, check_layers=(check,), deviation=deviation))
    # Brute force: before the check layer every token is recomputed, so the fresh K/V there are
    # the full prefill's; compare them with the stored ones, token by token.
    cached_pos, stored_k, stored_v = [], [], []
    pos = 0
    for seg in segments:
        if seg.kv is not None:
            cached_pos += range(pos, pos + len(seg.token_ids))
            stored_k.append(seg.kv.keys[check])
            stored_v.append(seg.kv.values[check])
        pos += len(seg.token_ids)
    full_k, full_v = full.cache.layer(check)
    cos, sin = engine.runner.rope(torch.tensor(cached_pos, device=engine.device))
    from blend_engine.runner import apply_rope
    if deviation == DeviationKind.KEY:
        fresh, stored = full_k[:, cached_pos], apply_rope(torch.cat(stored_k, 1), cos, sin)
    else:
        fresh, stored = full_v[:, cached_pos], torch.cat(stored_v, 1)
    dev = ((fresh - stored) ** 2).sum(dim=(0, 2))
    num_keep = round(ratio * len(cached_pos))
    expected = sorted(torch.tensor(cached_pos)[torch.topk(dev, num_keep).indices].tolist())
    assert blend.stats.selected_positions == expected
    num_uncached = len(full.token_ids) - len(cached_pos)
    assert blend.stats.num_recomputed_tokens == num_uncached + num_keep


def test_gradual_filtering_keeps_a_subset_at_each_check():
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    config = BlendConfig.cacheblend(recompute_ratio=0.1, check_layers=(1, 2), filter_growth=3.0)
    result = engine.prefill(segments, PrefillMode.BLEND, config)
    num_cached = sum(len(s.token_ids) for s in segments if s.kv is not None)
    assert len(result.stats.selected_positions) == round(0.1 * num_cached)
    assert config.ratio_at_check(0) == pytest.approx(0.3)


def test_given_positions_replace_the_ranking():
    """Two caches of the same chunks compared under one selection (the KV formats' bench): the positions
    a ranked blend chose, given back, give the same prefill; other positions are what gets recomputed."""
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    ranked = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=0.2))
    chosen = tuple(ranked.stats.selected_positions)
    given = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=0.2, selected_positions=chosen))
    assert given.stats.selected_positions == list(chosen)
    assert torch.equal(given.logits, ranked.logits)
    cached = [p for p in range(len(ranked.token_ids)) if p not in chosen and p >= len(segments[0].token_ids)]
    other = tuple(cached[:len(chosen)])
    assert set(other) != set(chosen)
    moved = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=0.2, selected_positions=other))
    assert moved.stats.selected_positions == list(other)
    assert not torch.equal(moved.logits, ranked.logits)
    with pytest.raises(ValueError, match="selected_positions"):
        BlendConfig.cacheblend(selected_positions=(-1,))


def test_select_top_and_deviation():
    dev = torch.tensor([0.5, 3.0, 1.0, 2.0, 0.1])
    assert select_top(dev, 2).tolist() == [1, 3]
    assert select_top(dev, 0).tolist() == []
    a, b = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    b[1, 2, 0] = 2.0
    assert token_deviation(a, b).tolist() == [0.0, 0.0, 4.0]


@pytest.mark.parametrize("backend", list(AttentionBackend))
@pytest.mark.parametrize("num_queries", [6, 300])  # 300: several key cut-offs in the grouped backend
def test_attention_mask_matches_brute_force_reference(num_queries, backend):
    engine = build_engine("llama-gqa")
    runner: ModelRunner = engine.runner
    g = torch.Generator().manual_seed(0)
    num_keys, heads, kv_heads, dim = 400, runner.num_heads, runner.num_kv_heads, runner.head_dim
    query_pos = torch.randperm(num_keys, generator=g)[:num_queries].sort().values
    q = torch.randn(heads, num_queries, dim, generator=g)
    k, v = torch.randn(kv_heads, num_keys, dim, generator=g), torch.randn(kv_heads, num_keys, dim, generator=g)
    meta = subset_meta(query_pos, num_keys, backend, heads // kv_heads)
    out = attend(q, k, v, meta, runner.scaling).view(num_queries, heads, dim)
    group = heads // kv_heads
    for i, p in enumerate(query_pos.tolist()):
        for h in range(heads):
            scores = (k[h // group, : p + 1] @ q[h, i]) * runner.scaling  # keys 0..p only
            ref = torch.softmax(scores, 0) @ v[h // group, : p + 1]
            torch.testing.assert_close(out[i, h], ref, **tol(1e-5))
    mask = causal_mask(query_pos, num_keys)
    assert mask.sum(1).tolist() == [p + 1 for p in query_pos.tolist()]


def test_grouped_attention_cuts_queries_in_whole_blocks():
    """The CPU backend's query groups cover every query once, at most MAX_QUERY_GROUPS of them, each but the
    last a whole number of the flash kernel's 64-row blocks (a group of 65 rows ran a block of one row)."""
    for num_queries in [1, 63, 64, 65, 191, 192, 193, 300, 521, 900, 1600, 5000]:
        bounds = query_group_bounds(num_queries)
        sizes = [b - a for a, b in itertools.pairwise(bounds)]
        assert bounds[0] == 0 and bounds[-1] == num_queries and all(size > 0 for size in sizes)
        assert len(sizes) <= MAX_QUERY_GROUPS and all(size % QUERY_BLOCK_ROWS == 0 for size in sizes[:-1])
    assert query_group_bounds(521) == [0, 192, 384, 521] and query_group_bounds(150) == [0, 150]


def test_recomputed_tokens_never_see_later_positions():
    """Changing a later chunk leaves every earlier position's KV untouched (no look-ahead)."""
    engine = build_engine("llama-gqa")
    a, b1, b2 = random_ids(20, 40), random_ids(20, 41), random_ids(20, 42)
    # a sparse selection: selected tokens of `a` sit among reused ones, with `b` after them
    config = BlendConfig.cacheblend(recompute_ratio=0.3)
    head = Segment(random_ids(5, 43))  # puts `a` off its precompute context, so some of it is selected
    one = engine.prefill([head, Segment(a, engine.precompute(a)), Segment(b1, engine.precompute(b1))],
                         PrefillMode.BLEND, config)
    two = engine.prefill([head, Segment(a, engine.precompute(a)), Segment(b2, engine.precompute(b2))],
                         PrefillMode.BLEND, config)
    n = len(head.token_ids) + len(a)
    assert any(p < n for p in one.stats.selected_positions)
    torch.testing.assert_close(one.cache.keys[:, :, :n], two.cache.keys[:, :, :n], **tol(1e-6))
    torch.testing.assert_close(one.cache.values[:, :, :n], two.cache.values[:, :, :n], **tol(1e-6))
