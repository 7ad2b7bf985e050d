"""The loading controller: the recompute ratio that the loads can hide, bounded by floor and ceiling."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blend_engine.engine import BlendEngine
from blend_engine.kv import ChunkKV
from configs.settings import StorageDtype
from kv_store import EngineProfile, KVStore, LoadingController, StoreConfig, StoredChunk, Tier
from kv_store.controller import PRIOR_THROUGHPUT

PROFILE = EngineProfile(num_layers=10, seconds_per_token_layer=1e-5)  # 1e-4 s per token through the model


def handle(tier: Tier, num_tokens=1000, layer_nbytes=1_000_000) -> StoredChunk:
    return StoredChunk("0" * 64, tier, tuple(range(num_tokens)), (), 10, layer_nbytes)


def test_ratio_is_where_compute_equals_load():
    controller = LoadingController(min_ratio=0.05)
    # 2 chunks x 10 layers x 1 MB at 200 MB/s = 0.1 s of loads; 2000 cached tokens at 1e-4 s each
    decision = controller.choose([handle(Tier.DISK)] * 2, PROFILE, {Tier.DISK: 200e6})
    assert decision.predicted_load_s == pytest.approx(0.1)
    assert decision.ratio == pytest.approx(0.5)  # 0.5 * 2000 tokens * 1e-4 s = 0.1 s
    assert decision.predicted_compute_s == pytest.approx(decision.predicted_load_s)
    assert not decision.is_floor_applied


def test_fresh_tokens_count_toward_hiding():
    controller = LoadingController(min_ratio=0.0)
    decision = controller.choose([handle(Tier.DISK)] * 2, PROFILE, {Tier.DISK: 200e6}, num_fresh_tokens=200)
    assert decision.ratio == pytest.approx(0.4)  # (1000 - 200) / 2000


def test_floor_and_ceiling():
    fast = LoadingController(min_ratio=0.15).choose([handle(Tier.MEMORY)], PROFILE, {Tier.MEMORY: 50e9})
    assert fast.ratio == 0.15 and fast.is_floor_applied and fast.hiding_ratio < 0.15
    slow = LoadingController(min_ratio=0.15, max_ratio=0.6).choose([handle(Tier.REDIS)], PROFILE, {Tier.REDIS: 1e6})
    assert slow.ratio == 0.6 and slow.hiding_ratio > 1
    with pytest.raises(ValueError, match="min_ratio"):
        LoadingController(min_ratio=0.7, max_ratio=0.5)


def test_unmeasured_tier_uses_prior_and_slower_tiers_get_higher_ratios():
    controller = LoadingController(min_ratio=0.0)
    ratios = {t: controller.choose([handle(t)], PROFILE, {}).ratio for t in Tier}
    assert ratios[Tier.MEMORY] < ratios[Tier.DISK] < ratios[Tier.REDIS]
    expected = 10 * 1e6 / PRIOR_THROUGHPUT[Tier.DISK] / 1e-4 / 1000
    assert ratios[Tier.DISK] == pytest.approx(expected)


def test_engine_profile_measure_and_store_reports_choice(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    engine = BlendEngine.from_model(LlamaForCausalLM(config), name="tiny-llama")
    profile = EngineProfile.measure(engine, num_tokens=64, num_repeats=1)
    assert profile.num_layers == 4 and 0 < profile.seconds_per_token_layer < 0.1
    with pytest.raises(ValueError, match="profile"):
        EngineProfile(num_layers=4, seconds_per_token_layer=0.0)

    store = KVStore(engine.fingerprint, StoreConfig(dtype=StorageDtype.FLOAT32, disk_dir=tmp_path, max_memory_bytes=0,
                                                    fsync=False, min_recompute_ratio=0.1))
    kv = engine.precompute(list(range(2, 50)))
    key = store.key_for(kv.token_ids, kv.context_ids)
    store.put(key, kv)
    assert store.stats().tiers["disk"].load_throughput is None  # nothing loaded yet: priors
    h = store.handle(key)
    source = store.layer_source([h], "cpu", torch.float32, pipelined=False)
    for layer in range(4):
        source.layer(layer)
    source.close()
    measured = store.stats().tiers["disk"].load_throughput
    assert measured is not None and measured > 0
    ratio = store.choose_ratio([h], profile)
    stats = store.stats()
    assert stats.num_auto_ratio_choices == 1 and stats.last_auto_ratio == ratio
    assert 0.1 <= ratio <= 1.0
    expected = store.controller.choose([h], profile, {Tier.DISK: measured}).ratio
    assert ratio == pytest.approx(expected)


def test_chunk_kv_and_handle_satisfy_segment_contract():
    from blend_engine.types import Segment

    h = handle(Tier.DISK, num_tokens=3)
    assert Segment((1, 2, 3), h).kv.num_tokens == 3
    with pytest.raises(ValueError):
        Segment((1, 2), h)
    kv = ChunkKV((1,), (), torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    assert Segment((1,), kv).kv is kv
