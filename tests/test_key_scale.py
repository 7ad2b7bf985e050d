"""`BlendConfig.reused_key_scale`: the keys of reused chunks not computed at their place are scaled
after the last check layer, exact chunks and every value untouched, and blend stays exact at ratio 1."""

import pytest
import torch

from blend_engine.plan import plan_prefill
from blend_engine.types import BlendConfig, PrefillMode, Segment
from configs.settings import load_settings
from engine_models import MODEL_BUILDERS, build_engine, random_ids
from test_engine_blend import assert_same_prefill, rag_prompt

SCALE = 0.8


def exact_first_prompt(engine):
    """rag_prompt whose first chunk is precomputed behind the prefix: its KV is a full prefill's."""
    segments = rag_prompt(engine)
    prefix, first = segments[0], segments[1]
    segments[1] = Segment(first.token_ids, engine.precompute(first.token_ids, prefix.token_ids))
    return segments


def spans_of(segments) -> list[tuple[int, int]]:
    out, pos = [], 0
    for seg in segments:
        if seg.kv is not None:
            out.append((pos, pos + len(seg.token_ids)))
        pos += len(seg.token_ids)
    return out


def test_plan_marks_only_chunks_computed_behind_their_own_prefix_as_exact():
    engine = build_engine("llama-gqa")
    segments = exact_first_prompt(engine)
    plan = plan_prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend(reused_key_scale=SCALE, check_layers=(2,)), 4)
    assert [s.is_exact for s in plan.spans] == [True, False, False]
    assert plan.first_scaled_layer == 3
    assert not plan.is_scaled(plan.spans[0], 3)
    assert plan.is_scaled(plan.spans[1], 3) and not plan.is_scaled(plan.spans[1], 2)
    unscaled = plan_prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend(), 4)
    assert not any(unscaled.is_scaled(s, 3) for s in unscaled.spans)


@pytest.mark.parametrize("is_bulk", [False, True])
@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_reuse_scales_the_inexact_chunks_keys_after_the_check_layer(family, is_bulk):
    engine = build_engine(family)
    engine.is_bulk_layout = is_bulk
    segments = exact_first_prompt(engine)
    plain = engine.prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend())
    scaled = engine.prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend(reused_key_scale=SCALE))
    (a, b), *inexact = spans_of(segments)
    cut = 2  # the layer after the default check layer 1
    torch.testing.assert_close(scaled.cache.keys[:, :, a:b], plain.cache.keys[:, :, a:b], rtol=0, atol=0)
    for start, end in inexact:
        torch.testing.assert_close(scaled.cache.keys[:cut, :, start:end], plain.cache.keys[:cut, :, start:end],
                                   rtol=0, atol=0)
        torch.testing.assert_close(scaled.cache.keys[cut:, :, start:end], plain.cache.keys[cut:, :, start:end] * SCALE)
        torch.testing.assert_close(scaled.cache.values[:, :, start:end], plain.cache.values[:, :, start:end],
                                   rtol=0, atol=0)
    assert not torch.allclose(scaled.logits, plain.logits)  # the question attends to the scaled keys


@pytest.mark.parametrize("family", list(MODEL_BUILDERS))
def test_blend_with_scaled_keys_at_ratio_one_equals_full(family):
    engine = build_engine(family)
    segments = exact_first_prompt(engine)
    full = engine.prefill(segments, PrefillMode.FULL)
    blend = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=1.0, reused_key_scale=SCALE))
    assert_same_prefill(blend, full)


def test_blend_scales_only_the_tokens_it_does_not_recompute():
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, chunk_len=40)
    config = BlendConfig.cacheblend(recompute_ratio=0.3)
    plain = engine.prefill(segments, PrefillMode.BLEND, config)
    scaled = engine.prefill(segments, PrefillMode.BLEND, BlendConfig.cacheblend(recompute_ratio=0.3, reused_key_scale=SCALE))
    # layers 0..1 are computed alike, so the selection at check layer 1 is the same
    assert scaled.stats.selected_positions == plain.stats.selected_positions
    selected = set(plain.stats.selected_positions)
    kept = [p for start, end in spans_of(segments) for p in range(start, end) if p not in selected]
    torch.testing.assert_close(scaled.cache.keys[2:, :, kept], plain.cache.keys[2:, :, kept] * SCALE)


def test_scale_is_validated_in_config_and_settings():
    with pytest.raises(ValueError, match="reused_key_scale"):
        BlendConfig.cacheblend(reused_key_scale=0.0)
    with pytest.raises(ValueError):
        load_settings(None, blend={"reused_key_scale": -1})
    settings = load_settings(None, blend={"reused_key_scale": 0.9})
    assert settings.blend.reused_key_scale == 0.9


def test_prompt_without_inexact_chunks_is_untouched():
    """Prefix mode only uses exact chunks: the scale changes nothing."""
    engine = build_engine("llama-gqa")
    segments = exact_first_prompt(engine)[:2] + [Segment(random_ids(8, 5))]
    plain = engine.prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend())
    scaled = engine.prefill(segments, PrefillMode.REUSE, BlendConfig.cacheblend(reused_key_scale=SCALE))
    assert_same_prefill(scaled, plain, atol=0)
