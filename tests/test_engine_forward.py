"""Our layer loop against Hugging Face's own forward, and RoPE re-positioning of stored keys."""

import pytest
import torch

from blend_engine.runner import apply_rope
from blend_engine.types import PrefillMode, Segment
from engine_models import tol, MODEL_BUILDERS, build_engine, random_ids

FAMILIES = list(MODEL_BUILDERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_own_forward_equals_hf_forward(family):
    engine = build_engine(family)
    ids = random_ids(48, seed=1)
    with torch.no_grad():
        ref = engine.model(torch.tensor([ids], device=engine.device)).logits[0].float()  # [n, vocab], fp32 as ours
    result = engine.prefill([Segment(ids[:20])], PrefillMode.FULL)
    torch.testing.assert_close(result.logits, ref[19], **tol(1e-4))
    # the decode path (one forward over the rest against the prefilled cache) too
    rest = engine.forward_tokens(result, ids[20:])
    torch.testing.assert_close(rest, ref[20:], **tol(1e-4))
    # the last token's logits alone (a prompt fed in chunks): the same row
    again = engine.prefill([Segment(ids[:20])], PrefillMode.FULL)
    last = engine.forward_tokens(again, ids[20:], is_last_only=True)
    assert last.shape == (1, ref.shape[-1])
    torch.testing.assert_close(last[0], ref[-1], **tol(1e-4))


@pytest.mark.parametrize("family", FAMILIES)
def test_full_prefill_last_logits_equal_hf(family):
    engine = build_engine(family)
    ids = random_ids(64, seed=2)
    with torch.no_grad():
        ref = engine.model(torch.tensor([ids], device=engine.device)).logits[0, -1].float()
    result = engine.prefill([Segment(ids[:30]), Segment(ids[30:])], PrefillMode.FULL)
    torch.testing.assert_close(result.logits, ref, **tol(1e-4))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("offset", [0, 7, 300])
def test_chunk_placed_at_offset_has_keys_computed_there(family, offset):
    """A chunk computed at position 0, rotated to offset p, has the K of the chunk computed at p."""
    engine = build_engine(family)
    chunk = random_ids(24, seed=3)
    kv = engine.precompute(chunk)
    positions = torch.arange(offset, offset + len(chunk), device=engine.device)
    with torch.no_grad():
        out = engine.model(torch.tensor([chunk], device=engine.device), position_ids=positions[None], use_cache=True)
    cos, sin = engine.runner.rope(positions)
    for layer in range(engine.num_layers):
        hf_keys = out.past_key_values.layers[layer].keys[0]  # [H_kv, n, D], post-RoPE at p..
        torch.testing.assert_close(apply_rope(kv.keys[layer], cos, sin), hf_keys, **tol(1e-5))
        torch.testing.assert_close(kv.values[layer], out.past_key_values.layers[layer].values[0], **tol(1e-5))


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_places_chunk_keys_at_their_prompt_positions(family):
    engine = build_engine(family)
    head, chunk = random_ids(11, seed=4), random_ids(16, seed=5)
    tail = random_ids(5, seed=6)
    kv = engine.precompute(chunk)
    result = engine.prefill([Segment(head), Segment(chunk, kv), Segment(tail)], PrefillMode.REUSE)
    positions = torch.arange(len(head), len(head) + len(chunk), device=engine.device)
    cos, sin = engine.runner.rope(positions)
    for layer in range(engine.num_layers):
        keys, values = result.cache.layer(layer)
        torch.testing.assert_close(keys[:, positions], apply_rope(kv.keys[layer], cos, sin), **tol(1e-6))
        torch.testing.assert_close(values[:, positions], kv.values[layer], atol=0, rtol=0)
