"""Prompts that crashed other CacheBlend implementations: each runs, and at r=1 equals full."""

import pytest
import torch

from blend_engine.types import BlendConfig, PrefillMode, Segment
from engine_models import tol, build_engine, random_ids

ALL = BlendConfig.cacheblend(recompute_ratio=1.0)


def check_all_modes(engine, segments):
    full = engine.prefill(segments, PrefillMode.FULL)
    for mode in PrefillMode:
        result = engine.prefill(segments, mode)
        assert torch.isfinite(result.logits).all()
        assert result.cache.length == len(full.token_ids)
    blend = engine.prefill(segments, PrefillMode.BLEND, ALL)
    torch.testing.assert_close(blend.logits, full.logits, **tol(1e-4))
    return full


@pytest.fixture(scope="module")
def engine():
    return build_engine("llama-gqa")


def test_same_chunk_twice(engine):
    chunk = random_ids(15, 50)
    kv = engine.precompute(chunk)
    check_all_modes(engine, [Segment(random_ids(3, 51)), Segment(chunk, kv), Segment(chunk, kv), Segment(random_ids(4, 52))])


def test_all_chunks_cached_but_reordered(engine):
    chunks = [random_ids(12, 60 + i) for i in range(3)]
    kvs = [engine.precompute(c) for c in chunks]
    order = [2, 0, 1]
    segments = [Segment(chunks[i], kvs[i]) for i in order] + [Segment(random_ids(3, 64))]
    check_all_modes(engine, segments)
    reuse = engine.prefill(segments, PrefillMode.REUSE)
    assert reuse.stats.num_reused_tokens == 36


def test_one_token_chunk(engine):
    one = random_ids(1, 70)
    check_all_modes(engine, [Segment(random_ids(5, 71)), Segment(one, engine.precompute(one)), Segment(random_ids(3, 72))])


def test_empty_segment(engine):
    empty = engine.precompute(())
    assert empty.num_tokens == 0
    check_all_modes(engine, [Segment(random_ids(5, 80)), Segment((), empty), Segment(()), Segment(random_ids(3, 81))])


def test_prompt_with_no_chunks(engine):
    full = check_all_modes(engine, [Segment(random_ids(9, 90))])
    assert engine.prefill([Segment(random_ids(9, 90))], PrefillMode.BLEND).stats.num_reused_tokens == 0
    assert full.stats.num_cached_tokens == 0


def test_prompt_ending_in_a_cached_chunk_recomputes_its_last_token(engine):
    chunk = random_ids(10, 95)
    segments = [Segment(random_ids(4, 96)), Segment(chunk, engine.precompute(chunk))]
    result = engine.prefill(segments, PrefillMode.REUSE)
    assert result.stats.num_reused_tokens == 9
    check_all_modes(engine, segments)


def test_empty_prompt_is_an_error(engine):
    with pytest.raises(ValueError, match="empty prompt"):
        engine.prefill([Segment(())], PrefillMode.FULL)


def test_kv_of_wrong_length_is_an_error(engine):
    kv = engine.precompute(random_ids(5, 97))
    with pytest.raises(ValueError, match="tokens but its KV"):
        Segment(random_ids(6, 98), kv)


def test_prompt_over_context_is_an_error(engine):
    with pytest.raises(ValueError, match="exceeds"):
        engine.prefill([Segment(random_ids(500, 99))], PrefillMode.FULL, max_new_tokens=100)
