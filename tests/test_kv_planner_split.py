"""The split plan (as Cake): the front chunks computed as fresh tokens while the rear ones load, k
where the two meet; chosen only where it is predicted faster, and it computes exactly its reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from app.metrics import Metrics
from app.query.protocol import PlanOut
from runtime.planning import planned_segments
from blend_engine.types import BlendConfig, PrefillMode, Segment
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier
from kv_store.planner import PlanKind, PlanRequest, PrefillShape
from tests.engine_models import build_engine
from tests.test_kv_planner import chunks, planner_with_model, request

DISK_4GBPS = {Tier.DISK: 4e9}  # with the model below, 5 chunks of 600 tokens load in ~95 ms, full takes ~79 ms


def test_split_is_chosen_where_the_front_compute_hides_the_rear_load():
    planner = planner_with_model()
    stored = chunks([Tier.DISK] * 5)
    plan = planner.plan(request(stored), DISK_4GBPS)
    full = planner.full(request(stored))
    blend = planner.plan(request(stored), DISK_4GBPS, is_blend_only=True)
    assert plan.kind is PlanKind.SPLIT and 0 < plan.num_front_computed < 5
    assert plan.predicted_ttft_ms < full.predicted_ttft_ms and plan.predicted_ttft_ms < blend.predicted_ttft_ms
    k = plan.num_front_computed
    assert plan.reused_mask(stored) == [False] * k + [True] * (5 - k)
    # k is where they meet: one chunk fewer in front leaves a longer load, one more a longer compute
    fewer, more = planner._split(request(stored), k - 1, DISK_4GBPS), planner._split(request(stored), k + 1, DISK_4GBPS)
    assert k == 1 or fewer.predicted_load_ms > plan.predicted_ttft_ms
    assert k == 4 or more.predicted_compute_ms > plan.predicted_ttft_ms
    with pytest.raises(ValueError, match="by position"):
        plan.is_reused(stored[0])


def test_fast_tiers_blend_and_very_slow_ones_fall_back_to_full():
    planner = planner_with_model()
    for tier, rate in ((Tier.MEMORY, None), (Tier.GPU, None), (Tier.DISK, 64e9)):
        plan = planner.plan(request(chunks([tier] * 5)), {tier: rate})
        assert plan.kind is PlanKind.BLEND and plan.num_front_computed == 0, (tier, plan)
    slow = planner.plan(request(chunks([Tier.DISK] * 5)), {Tier.DISK: 20e6})  # even the last chunk loads too long
    assert slow.kind is PlanKind.FULL


def test_a_single_chunk_is_never_split():
    planner = planner_with_model()
    plan = planner.plan(request(chunks([Tier.DISK])), DISK_4GBPS)
    assert plan.kind is not PlanKind.SPLIT


def test_a_split_plan_computes_exactly_its_reference(tmp_path):
    """The planned prompt (front chunks fresh, rear streamed from a throttled disk) gives the logits of
    the same prompt with the rear chunks' KV from memory."""
    engine = build_engine("llama-gqa")
    parts = [tuple(range(10 + 20 * i, 30 + 20 * i)) for i in range(4)]
    kvs = [engine.precompute(p) for p in parts]
    question = Segment(tuple(range(200, 208)))
    store = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=0, disk_dir=tmp_path, fsync=False,
                                      throttle_mbps={Tier.DISK: 0.2}, dtype=StorageDtype.FLOAT32),
                    shape=engine.kv_shape)
    keys = [store.key_for(p) for p in parts]
    for key, kv in zip(keys, kvs):
        store.put(key, kv)
    handles = [store.handle(k) for k in keys]
    reader = store.backend(Tier.DISK).open_reader(keys[0])
    reader.read_layer(0)  # one measured load: the disk reads at 200 kB/s, ~75 ms a chunk
    reader.close()
    for n in (16, 64, 128):  # ~1 ms per token: loading all four chunks (~300 ms) loses to full (~88 ms)
        store.planner.observe(PrefillShape(n, n, 0, 0.0), n * 1e-3)
    plan = store.plan(PlanRequest(handles, 88, 8, first_reused_layer=1, num_layers=4))
    assert plan.kind is PlanKind.SPLIT and plan.num_front_computed == 3, plan

    segments = planned_segments([Segment(p, h) for p, h in zip(parts, handles)] + [question], plan)
    assert [s.kv is not None for s in segments] == [False, False, False, True, False]
    blend = replace(BlendConfig.cacheblend(), recompute_ratio=plan.ratio)
    source = store.layer_source([s.kv for s in segments if s.kv is not None], "cpu", torch.float32, start_layer=1)
    got = engine.prefill(segments, PrefillMode.BLEND, blend, kv_source=source)
    source.close()
    reference = engine.prefill([Segment(p) for p in parts[:3]] + [Segment(parts[3], kvs[3]), question],
                               PrefillMode.BLEND, blend)
    assert torch.allclose(got.logits, reference.logits, atol=1e-5)
    store.close()


def test_split_plans_are_reported_and_counted():
    out = PlanOut(plan="split", recompute_ratio=0.2, num_chunks_recomputed=3, predicted_load_ms=1.0,
                  predicted_compute_ms=2.0, predicted_ttft_ms=2.0, actual_load_ms=1.0, actual_prefill_ms=2.0)
    assert out.plan == "split"
    metrics = Metrics()
    metrics.observe_plan("split", 2.0, 2.0)
    assert 'ragblend_load_plans_total{plan="split"} 1.0' in metrics.render().decode()
