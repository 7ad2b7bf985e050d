"""The loading planner: cost model fit, plan choice per tier speed, the throttled tier, and that a
planned prefill computes what its plan says (every plan matches its own reference)."""

from __future__ import annotations

import time

import pytest
import torch

from blend_engine.types import BlendConfig, PrefillMode, Segment
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier
from kv_store.loader import StoredChunk
from kv_store.planner import CostModel, LoadPlanner, PlanKind, PlanRequest, PrefillShape
from kv_store.throttle import ThrottledBackend
from tests.engine_models import build_engine

# seconds = 1 ms + 10 us per token + 5 ns per attended pair + 1 us per reused token
TRUE_WEIGHTS = (1e-3, 1e-5, 5e-9, 1e-6)
NUM_LAYERS = 32


def measured(shape: PrefillShape) -> float:
    return sum(w * x for w, x in zip(TRUE_WEIGHTS, shape.features()))


def planner_with_model() -> LoadPlanner:
    planner = LoadPlanner(min_ratio=0.15)
    for n in (64, 256, 1024, 3000):
        planner.observe(PrefillShape(n, n, 0, 0.0), measured(PrefillShape(n, n, 0, 0.0)))
    for c, m in ((40, 1000), (300, 2000)):
        shape = PrefillShape(m + 40, c, m, 31 / 32)
        planner.observe(shape, measured(shape))
    return planner


def chunks(tiers: list[Tier], num_tokens: int = 600, layer_nbytes: int = 600 * 2 * 8 * 128 * 2) -> list[StoredChunk]:
    return [StoredChunk(f"k{i}", tier, tuple(range(num_tokens)), (), NUM_LAYERS, layer_nbytes)
            for i, tier in enumerate(tiers)]


def request(stored: list[StoredChunk]) -> PlanRequest:
    n = sum(c.num_tokens for c in stored) + 70
    return PlanRequest(stored, n, 70, first_reused_layer=1, num_layers=NUM_LAYERS)


def test_cost_model_recovers_the_weights_of_measured_prefills():
    model = planner_with_model().cost_model
    for got, want in zip(model.weights, TRUE_WEIGHTS):
        assert got == pytest.approx(want, rel=1e-3)
    full = PrefillShape(3070, 3070, 0, 0.0)
    blend = PrefillShape(3070, 520, 3000, 31 / 32)
    assert model.seconds(blend) < model.seconds(full)


def test_cost_model_never_predicts_negative_terms():
    # two noisy samples of one length: an unconstrained fit could give a negative slope
    model = CostModel.fit([(PrefillShape(100, 100, 0, 0.0), 0.02), (PrefillShape(200, 200, 0, 0.0), 0.019)])
    assert all(w >= 0 for w in model.weights)


def test_fast_tiers_blend_at_the_floor_and_slow_ones_fall_back_to_full():
    planner = planner_with_model()
    fast = planner.plan(request(chunks([Tier.MEMORY] * 5)), {Tier.MEMORY: None})  # not measured: prior
    assert fast.kind is PlanKind.BLEND and fast.ratio == pytest.approx(0.15)
    assert fast.predicted_ttft_ms < planner.full(request(chunks([Tier.MEMORY] * 5))).predicted_ttft_ms
    slow = planner.plan(request(chunks([Tier.DISK] * 5)), {Tier.DISK: 20e6})  # 20 MB/s
    assert slow.kind is PlanKind.FULL and slow.predicted_load_ms == 0


def test_mixed_reuses_the_fast_tier_and_computes_the_slow_one():
    planner = planner_with_model()
    stored = chunks([Tier.MEMORY, Tier.MEMORY, Tier.MEMORY, Tier.MEMORY, Tier.DISK])
    plan = planner.plan(request(stored), {Tier.MEMORY: None, Tier.DISK: 20e6})
    assert plan.kind is PlanKind.MIXED and plan.reused_tiers == {Tier.MEMORY}
    assert [plan.is_reused(c) for c in stored] == [True] * 4 + [False]


def test_ratio_rises_to_what_the_loads_hide_and_explicit_blend_never_falls_back():
    planner = planner_with_model()
    stored = chunks([Tier.DISK] * 5)
    floor = planner.plan(request(stored), {Tier.DISK: 1e12}, is_blend_only=True)
    moderate = planner.plan(request(stored), {Tier.DISK: 10e9}, is_blend_only=True)
    slow = planner.plan(request(stored), {Tier.DISK: 1e6}, is_blend_only=True)
    assert floor.ratio == pytest.approx(0.15)
    assert 0.15 < moderate.ratio < 1.0
    assert moderate.predicted_compute_ms <= moderate.predicted_load_ms * 1.001
    assert slow.kind is PlanKind.BLEND and slow.ratio == 1.0


def test_planner_refuses_to_plan_before_any_measurement():
    with pytest.raises(RuntimeError, match="no measured prefill"):
        LoadPlanner(0.15).plan(request(chunks([Tier.MEMORY])), {})


def test_throttled_tier_sleeps_per_byte_and_counts_it_as_load_time(tmp_path):
    engine = build_engine("llama-gqa")
    store = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=0, disk_dir=tmp_path, fsync=False,
                                      throttle_mbps={Tier.DISK: 2.0}), shape=engine.kv_shape)
    ids = tuple(range(5, 69))
    key = store.key_for(ids)
    store.put(key, engine.precompute(ids))
    assert isinstance(store.backend(Tier.DISK), ThrottledBackend)
    handle = store.handle(key)
    expected_s = handle.layer_nbytes * handle.num_layers / 2e6
    start = time.perf_counter()
    source = store.layer_source([handle], "cpu", torch.float32, pipelined=False)
    for layer in range(handle.num_layers):
        source.layer(layer)
    source.close()
    assert time.perf_counter() - start >= expected_s
    throughput = store.stats().tiers["disk"].load_throughput
    assert throughput == pytest.approx(2e6, rel=0.5)  # the sleep dominates the measured reads
    store.close()


def test_every_plan_computes_what_it_says(tmp_path):
    """A mixed plan (slow chunk computed as fresh tokens) gives exactly the logits of the prompt with
    that chunk uncached; full gives full's; blend from a throttled tier gives blend from memory."""
    engine = build_engine("llama-gqa")
    parts = [tuple(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]
    kvs = [engine.precompute(p) for p in parts]
    question = Segment(tuple(range(200, 208)))
    blend = BlendConfig.cacheblend(recompute_ratio=0.3)
    reference_mixed = engine.prefill([Segment(parts[0], kvs[0]), Segment(parts[1], kvs[1]), Segment(parts[2]), question],
                                     PrefillMode.BLEND, blend)
    store = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=1 << 30, disk_dir=tmp_path, fsync=False,
                                      throttle_mbps={Tier.DISK: 0.02}, dtype=StorageDtype.FLOAT32),
                    shape=engine.kv_shape)
    keys = [store.key_for(p) for p in parts]
    for key, kv in zip(keys, kvs):
        store.put(key, kv)
    store.backend(Tier.MEMORY).delete(keys[2])  # the third chunk only on the slow disk
    handles = [store.handle(k) for k in keys]
    assert [h.tier for h in handles] == [Tier.MEMORY, Tier.MEMORY, Tier.DISK]
    reader = store.backend(Tier.DISK).open_reader(keys[2])
    reader.read_layer(0)  # one measured load: the disk reads at 20 kB/s
    reader.close()
    planner = store.planner
    for n in (16, 64, 128):  # a cost model where a prompt costs ~1 ms per token: loads at 20 kB/s lose
        planner.observe(PrefillShape(n, n, 0, 0.0), n * 1e-3)
    plan = store.plan(PlanRequest(handles, 68, 8, first_reused_layer=1, num_layers=4))
    assert plan.kind is PlanKind.MIXED
    segments = [Segment(p, h if plan.is_reused(h) else None) for p, h in zip(parts, handles)] + [question]
    used = [s.kv for s in segments if s.kv is not None]
    source = store.layer_source(used, "cpu", torch.float32, start_layer=1)
    got = engine.prefill(segments, PrefillMode.BLEND, blend, kv_source=source)
    source.close()
    assert torch.allclose(got.logits, reference_mixed.logits, atol=1e-5)
    store.close()


def test_prefetch_copies_chunks_up_to_memory_within_its_byte_bound(tmp_path):
    engine = build_engine("llama-gqa")
    parts = [tuple(range(10 + 20 * i, 30 + 20 * i)) for i in range(3)]
    kvs = [engine.precompute(p) for p in parts]
    config = StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=1 << 30, disk_dir=tmp_path, fsync=False, dtype=StorageDtype.FLOAT32,
                         write_tiers=frozenset({Tier.DISK}), max_prefetch_bytes=2 * kvs[0].nbytes)
    store = KVStore("fp", config, shape=engine.kv_shape)
    keys = [store.key_for(p) for p in parts]
    for key, kv in zip(keys, kvs):
        store.put(key, kv)
    memory = store.backend(Tier.MEMORY)
    assert not any(memory.contains(k) for k in keys)
    num_started = store.prefetch(keys + keys[:1])  # a repeated key is fetched once
    store._prefetcher.wait()
    assert 1 <= num_started <= 3 and all(memory.contains(k) for k in keys[:num_started])
    assert store.prefetch(keys) == 3 - num_started  # what is in memory already is skipped
    store._prefetcher.wait()
    assert all(memory.contains(k) for k in keys) and store.handle(keys[2]).tier is Tier.MEMORY
    assert torch.equal(store.get(keys[1]).keys, kvs[1].keys)
    store.close()


def test_prefetch_never_exceeds_its_bound_in_flight(tmp_path):
    engine = build_engine("llama-gqa")
    ids = tuple(range(10, 74))
    kv = engine.precompute(ids)
    store = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=1 << 30, disk_dir=tmp_path, fsync=False,
                                      write_tiers=frozenset({Tier.DISK}), max_prefetch_bytes=kv.nbytes // 4),
                    shape=engine.kv_shape)
    key = store.key_for(ids)
    store.put(key, kv)
    assert store.prefetch([key]) == 0 and not store.backend(Tier.MEMORY).contains(key)
    store.close()


def test_reuse_stays_unless_another_plan_is_clearly_faster():
    # loads that make blend a little slower than full (within the margin) keep the default plan; one
    # chunk (of five's size) so that no split can beat both (tests/test_kv_planner_split.py)
    planner = planner_with_model()
    stored = chunks([Tier.DISK], num_tokens=3000, layer_nbytes=5 * 600 * 2 * 8 * 128 * 2)
    full_ms = planner.full(request(stored)).predicted_ttft_ms
    bytes_per_chunk = stored[0].layer_nbytes * (NUM_LAYERS - 1)
    for slower, expected in ((0.98, PlanKind.BLEND), (1.5, PlanKind.FULL)):  # + read latencies ~1%
        rate = bytes_per_chunk / (full_ms / 1000 * slower)  # the loads alone take `slower` x full
        plan = LoadPlanner.plan(planner, request(stored), {Tier.DISK: rate})
        assert plan.kind is expected, (slower, plan)


def test_a_cached_prefix_is_planned_where_computing_the_rest_is_sooner():
    """The prefix cache's plan: the kept prefix reused as is, the rest computed through every layer;
    taken over the chunks' plan where predicted sooner (a follow-up's few new tokens), not where the
    kept prefix is only the system prompt (the rest would be nearly a full prefill)."""
    planner = planner_with_model()
    stored = chunks([Tier.MEMORY] * 5)
    base = request(stored)
    n = base.num_prompt_tokens
    follow_up = PlanRequest(stored, n, 70, first_reused_layer=1, num_layers=NUM_LAYERS, num_prefix_cached_tokens=n - 60)
    plan = planner.plan(follow_up, {})
    assert plan.kind is PlanKind.PREFIX_CACHE and plan.ratio is None and plan.predicted_load_ms == 0
    expected = measured(PrefillShape(n, 60, 0, 1.0)) * 1000
    assert plan.predicted_compute_ms == pytest.approx(expected, rel=1e-3)
    assert planner.plan(follow_up, {}, is_blend_only=True).kind is PlanKind.PREFIX_CACHE
    system_only = PlanRequest(stored, n, 70, first_reused_layer=1, num_layers=NUM_LAYERS, num_prefix_cached_tokens=30)
    assert planner.plan(system_only, {}).kind is PlanKind.BLEND
    assert planner.with_prefix_cache(system_only, planner.full(system_only)).kind is PlanKind.PREFIX_CACHE
    assert planner.plan(base, {}).kind is PlanKind.BLEND  # nothing cached: the chunks' plan, as before
    with pytest.raises(ValueError, match="leaves nothing or everything"):
        planner.prefix_cached(PlanRequest(stored, n, 70, 1, NUM_LAYERS, num_prefix_cached_tokens=n))


@pytest.mark.parametrize("reused_weight", [0.0, 1e-6, 1e-4])
def test_a_follow_up_is_planned_from_its_kept_prompt_whatever_a_reused_token_costs(reused_weight):
    """A follow-up's new tokens are computed by any plan; blending the whole prompt again computes them
    and more. So the kept prompt wins however high blends fitted the reused-token term (counted for
    the kept tokens too, it flipped follow-ups to blend: tests/test_prefix_server.py was flaky)."""
    weights = (*TRUE_WEIGHTS[:3], reused_weight)
    planner = LoadPlanner(min_ratio=0.15)
    for shape in (PrefillShape(64, 64, 0, 0.0), PrefillShape(256, 256, 0, 0.0), PrefillShape(1024, 1024, 0, 0.0),
                  PrefillShape(1040, 40, 1000, 31 / 32), PrefillShape(2040, 300, 2000, 31 / 32),
                  PrefillShape(3000, 30, 0, 1.0)):
        planner.observe(shape, sum(w * x for w, x in zip(weights, shape.features())))
    stored = chunks([Tier.MEMORY] * 2, num_tokens=30)
    n = 135  # system prompt and history fresh, two small chunks, 33 new tokens after the kept turn
    follow_up = PlanRequest(stored, n, n - 60, first_reused_layer=1, num_layers=NUM_LAYERS,
                            num_prefix_cached_tokens=n - 33)
    assert planner.plan(follow_up, {}).kind is PlanKind.PREFIX_CACHE
    assert planner.plan(follow_up, {}, is_blend_only=True).kind is PlanKind.PREFIX_CACHE
