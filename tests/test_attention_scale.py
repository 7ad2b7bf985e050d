"""`BlendConfig.reused_attention_scale`: after the last check layer, every query's attention weight on
a reused token of an inexact chunk is multiplied by the scale (a column bias of log scale), in the
prefill and for every token after it (teacher-forced scoring, decoding in each cache format); exact
chunks, fresh tokens and the tokens blend recomputes keep their weight, and blend stays exact at ratio 1."""

import math

import pytest
import torch

from blend_engine.attention import AttentionBackend, attend, attend_last, last_meta, subset_meta
from blend_engine.kv import ColumnBias, KVCache
from blend_engine.plan import plan_prefill
from blend_engine.types import BlendConfig, PrefillMode, Segment
from configs.enums import DecodeCache
from configs.settings import load_settings
from engine_models import MODEL_BUILDERS, build_engine, cpu_exact, random_ids, tol
from test_engine_blend import assert_same_prefill, rag_prompt
from test_key_scale import exact_first_prompt, spans_of

SCALE = 0.5
SCALED = BlendConfig.cacheblend(reused_attention_scale=SCALE)


def reference_attention(q, k, v, query_pos, bias, scaling):
    """Brute force: softmax(q.k * scaling + bias) over keys 0..p of each query: [A, H, D]."""
    heads, group = q.shape[0], q.shape[0] // k.shape[0]
    out = torch.empty(q.shape[1], heads, q.shape[2])
    for i, p in enumerate(query_pos):
        for h in range(heads):
            scores = (k[h // group, : p + 1] @ q[h, i]) * scaling + bias[: p + 1]
            out[i, h] = torch.softmax(scores, 0) @ v[h // group, : p + 1]
    return out


@pytest.mark.parametrize("backend", list(AttentionBackend))
@pytest.mark.parametrize("num_queries", [6, 300])
def test_subset_attention_with_a_column_bias_matches_brute_force(num_queries, backend):
    g = torch.Generator().manual_seed(1)
    num_keys, heads, kv_heads, dim = 400, 4, 2, 16
    query_pos = torch.randperm(num_keys, generator=g)[:num_queries].sort().values
    q = torch.randn(heads, num_queries, dim, generator=g)
    k, v = torch.randn(kv_heads, num_keys, dim, generator=g), torch.randn(kv_heads, num_keys, dim, generator=g)
    bias = torch.where(torch.rand(num_keys, generator=g) < 0.5, math.log(SCALE), 0.0)
    meta = subset_meta(query_pos, num_keys, backend, heads // kv_heads, bias=bias)
    out = attend(q, k, v, meta, 0.25).view(num_queries, heads, dim)
    ref = reference_attention(q, k, v, query_pos.tolist(), bias, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    plain = attend(q, k, v, subset_meta(query_pos, num_keys, backend, heads // kv_heads), 0.25)
    assert not torch.allclose(plain.view_as(out), out, atol=1e-3)


def test_one_query_attention_with_a_column_bias_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    num_keys, heads, kv_heads, dim = 50, 4, 2, 16
    q = torch.randn(heads, 1, dim, generator=g)
    k, v = torch.randn(kv_heads, num_keys, dim, generator=g), torch.randn(kv_heads, num_keys, dim, generator=g)
    bias = torch.where(torch.arange(num_keys) % 3 == 0, math.log(SCALE), 0.0)
    ref = reference_attention(q, k, v, [num_keys - 1], bias, 0.25).view(1, -1)
    torch.testing.assert_close(attend(q, k, v, last_meta(num_keys, bias), 0.25), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(attend_last(q, k, v, 0.25, bias), ref, atol=1e-5, rtol=0)


def test_plan_scales_the_attention_of_inexact_chunks_only():
    engine = build_engine("llama-gqa")
    segments = exact_first_prompt(engine)
    plan = plan_prefill(segments, PrefillMode.REUSE, SCALED, 4)
    (_, _), *inexact = spans_of(segments)
    assert plan.is_attention_scaled
    assert plan.scaled_attention_pos == tuple(p for a, b in inexact for p in range(a, b))
    assert not plan_prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend(), 4).is_attention_scaled
    assert not plan_prefill(segments, PrefillMode.FULL, SCALED, 4).is_attention_scaled
    assert not plan_prefill(segments, PrefillMode.PREFIX, SCALED, 4).is_attention_scaled


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_reuse_biases_the_inexact_chunks_and_changes_the_answer(family):
    engine = build_engine(family)
    segments = exact_first_prompt(engine)
    plain = engine.prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend())
    scaled = engine.prefill(segments, PrefillMode.REUSE, SCALED)
    assert plain.cache.column_bias is None
    bias = scaled.cache.column_bias
    expected = torch.zeros(bias.values.shape[0])
    (_, _), *inexact = spans_of(segments)
    for start, end in inexact:
        expected[start:end] = math.log(SCALE)
    assert bias.first_layer == 2  # the layer after the default check layer 1, as the key scale
    torch.testing.assert_close(bias.values.float().cpu(), expected, **tol(1e-6))
    assert bias.values.shape[0] == scaled.cache.capacity
    # the reused K/V are those of plain reuse: the scale acts on the attention weights only
    for start, end in spans_of(segments):
        torch.testing.assert_close(scaled.cache.keys[:, :, start:end], plain.cache.keys[:, :, start:end], **tol(1e-6))
    assert not torch.allclose(scaled.logits, plain.logits, atol=1e-3)


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_blend_with_an_attention_scale_at_ratio_one_equals_full(family):
    engine = build_engine(family)
    segments = exact_first_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    blend = engine.prefill(segments, PrefillMode.BLEND,
                           BlendConfig.cacheblend(recompute_ratio=1.0, reused_attention_scale=SCALE))
    assert_same_prefill(blend, full)


def test_blend_leaves_the_tokens_it_recomputes_unbiased():
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    result = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=0.3, reused_attention_scale=SCALE))
    selected = set(result.stats.selected_positions)
    assert selected
    bias = result.cache.column_bias.values
    resolution = max(1e-6, float(torch.finfo(bias.dtype).eps))  # log S rounded to the cache's dtype (bf16 on CUDA)
    bias = bias.float().cpu()
    for start, end in spans_of(segments):  # rag_prompt's chunks are computed alone: all inexact
        for p in range(start, end):
            assert float(bias[p]) == (0.0 if p in selected else pytest.approx(math.log(SCALE), abs=resolution))
    assert float(bias[: spans_of(segments)[0][0]].abs().sum()) == 0.0  # the fresh prefix


def question_appended(segments, token):
    """The same prompt with `token` appended to its fresh question segment."""
    last = segments[-1]
    return [*segments[:-1], Segment((*last.token_ids, token))]


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_scoring_and_decoding_attend_to_reused_tokens_as_the_prefill_does(family):
    """In reuse mode a token appended to the question is one more fresh token, so the prefill of the
    longer prompt predicts what scoring and decoding after the shorter one must: both with the bias."""
    engine = build_engine(family)
    segments, token = rag_prompt(engine), random_ids(1, 5)[0]
    longer = engine.prefill(question_appended(segments, token), PrefillMode.REUSE, SCALED)
    result = engine.prefill(segments, PrefillMode.REUSE, SCALED, max_new_tokens=4)
    scored = engine.score(result, [token, token])[1]  # the logits after `token`
    torch.testing.assert_close(scored, longer.logits, **tol(1e-4))
    stepped = engine.decoder(result, is_graphed=False).step(token)
    torch.testing.assert_close(stepped, longer.logits, **tol(1e-4))
    unbiased = engine.prefill(question_appended(segments, token), PrefillMode.REUSE, BlendConfig.cacheblend())
    # without the bias the decode would be off by far more than it is from the reference
    assert (unbiased.logits - longer.logits).abs().max() > 10 * (stepped - longer.logits).abs().max()


@cpu_exact
@pytest.mark.parametrize("fmt", [DecodeCache.BF16, DecodeCache.INT8])
def test_decode_caches_in_other_formats_keep_the_bias(fmt):
    from test_decode_cache import _quantized_engine
    from configs.enums import WeightFormat
    engine = _quantized_engine(WeightFormat.INT4)
    segments, tokens = rag_prompt(engine), random_ids(6, 78)
    result = engine.prefill(segments, PrefillMode.REUSE, SCALED, max_new_tokens=2)
    steps = torch.stack([engine.decoder(result, cache_format=fmt).step(t) for t in tokens[:1]])
    exact = torch.stack([engine.decoder(result, cache_format=DecodeCache.MODEL).step(t) for t in tokens[:1]])
    torch.testing.assert_close(steps, exact, atol=float(exact.abs().max()) * 2e-2, rtol=0)
    decoder = engine.decoder(result, cache_format=fmt)
    for t in tokens:  # past the prefill's capacity: the copy and its bias grow
        decoder.step(t)
    bias = decoder.cache.column_bias
    assert bias.values.shape[0] == decoder.cache.capacity
    assert float(bias.values[len(result.token_ids):].abs().sum()) == 0.0


def test_a_growing_cache_pads_its_bias_with_zeros():
    cache = KVCache(2, 1, 4, 8, torch.device("cpu"), torch.float32)
    cache.extend(8)
    cache.column_bias = ColumnBias(torch.full((8,), -1.0), first_layer=1)
    cache.extend(5)
    assert cache.capacity >= 13 and cache.column_bias.values.shape[0] == cache.capacity
    assert cache.column_bias.values[8:].abs().sum() == 0 and cache.column_bias.values[:8].eq(-1).all()
    assert cache.bias_at(0, 13) is None and cache.bias_at(1, 13).shape == (13,)


def test_attention_scale_is_validated_and_off_by_default():
    with pytest.raises(ValueError, match="reused_attention_scale"):
        BlendConfig.cacheblend(reused_attention_scale=0.0)
    with pytest.raises(ValueError, match="reused_attention_scale"):
        BlendConfig.cacheblend(reused_attention_scale=5.0)
    assert BlendConfig.cacheblend().reused_attention_scale == 1.0  # CacheBlend scales nothing; the server's default does
    assert load_settings().blend.reused_attention_scale == BlendConfig().reused_attention_scale == 0.5
