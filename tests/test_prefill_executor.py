"""The executor's prefills in parts (`PrefillExecutor.prefill_steps`, as the engine loop runs them): a
long blend prefill is cut by layers and answers exactly like one prefill, its store source (a loader
thread) is closed when the request is abandoned midway, and the loading planner's own full plans are
cut into token chunks with their plan report."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace

import pytest
import torch

from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode, SamplingParams, SelectionKind
from configs.enums import KVQuantization, RequestMode, StorageDtype
from configs.settings import load_settings
from kv_store import KVStore, StoreConfig, Tier
from kv_store.planner import PrefillShape
from runtime.config import SchedulerConfig
from runtime.executor import PrefillExecutor
from runtime.jobs import JobCancelled
from runtime.loop import EngineLoop
from runtime.types import PrefillRequest, PromptChunk

TOPICS = ["owls", "rivers", "copper", "violins", "glaciers", "tea"]
CHUNK_TOKENS = 16  # the executor's prefill_chunk_tokens: 16 x 4 layers = 64 token-layers a part


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> BlendEngine:
    # fp32 on one fixed thread: two runs of the same ops give the same bits
    settings = load_settings(data_dir=tmp_path_factory.mktemp("executor"),
                             model={"name": "random:tiny-llama", "device": "cpu", "weights": "fp32", "cpu_threads": 1})
    return BlendEngine.from_config(settings.model, settings.blend)


@pytest.fixture
def store(engine, tmp_path):
    """Every chunk on the disk tier only: a prefill streams them through a loader thread, which reads
    one layer ahead (the tiny model's 4 layers: else it would be through before the first part ends)."""
    store = KVStore(engine.fingerprint, StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32, fsync=False, disk_dir=tmp_path / "kv",
                                                    write_tiers=frozenset({Tier.DISK}), prefetch_depth=1),
                    shape=engine.kv_shape)
    yield store
    store.close()


def executor_for(engine, store, chunk_tokens: int = CHUNK_TOKENS) -> PrefillExecutor:
    settings = load_settings()
    return PrefillExecutor(engine, store, settings.blend, settings.store.planner_profile_tokens, chunk_tokens)


def stored_request(engine, store, mode: RequestMode) -> PrefillRequest:
    sink = engine.sink_ids(load_settings().blend.sink)
    chunks = []
    for topic in TOPICS:
        ids = tuple(engine.tokenize(" ".join(f"Fact {i} about {topic}: the {topic} number {i} is remarkable."
                                             for i in range(3))))
        key = store.key_for(ids, sink)
        store.put(key, engine.precompute(ids, sink))
        chunks.append(PromptChunk(ids, key))
    return PrefillRequest("What about owls and tea?", tuple(chunks), mode, SamplingParams(max_tokens=4))


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-prefetch" and t.is_alive()]


def run_steps(executor, request):
    steps = list(executor.prefill_steps(request))
    assert all(s is None for s in steps[:-1]) and steps[-1] is not None
    return len(steps) - 1, steps[-1]


def test_a_long_blend_prefill_is_cut_by_layers_and_answers_like_one_prefill(engine, store):
    before = prefetch_threads()  # another test's loader may still wait for the collector: not this one's
    request = stored_request(engine, store, RequestMode.BLEND)
    num_parts, cut = run_steps(executor_for(engine, store), request)
    num_whole, whole = run_steps(executor_for(engine, store, chunk_tokens=100_000), request)
    assert num_whole == 0 and num_parts >= 2
    a, b = cut.result, whole.result
    n = len(b.token_ids)
    assert n > 4 * CHUNK_TOKENS and a.token_ids == b.token_ids and a.stats.mode is PrefillMode.BLEND
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.cache.keys[:, :, :n], b.cache.keys[:, :, :n])
    assert torch.equal(a.cache.values[:, :, :n], b.cache.values[:, :, :n])
    assert a.stats.selected_positions == b.stats.selected_positions and a.stats.selected_positions
    assert (a.stats.num_cached_tokens, a.stats.num_reused_tokens, a.stats.num_recomputed_tokens) == (
        b.stats.num_cached_tokens, b.stats.num_reused_tokens, b.stats.num_recomputed_tokens)
    assert len(cut.handles) == len(TOPICS) and all(h.tier is Tier.DISK for h in cut.handles)
    assert prefetch_threads() == before


def test_abandoning_a_prefill_between_its_parts_closes_its_store_source(engine, store):
    # a deviation selection: the configured query probe would lay out every layer in the first part
    request = replace(stored_request(engine, store, RequestMode.BLEND), selection=SelectionKind.DEVIATION)
    before = prefetch_threads()
    steps = executor_for(engine, store).prefill_steps(request)
    assert next(steps) is None  # the first part ran; the store's loader thread waits for the next
    assert len(prefetch_threads()) == len(before) + 1
    steps.close()  # the client left (the engine loop closes it, on its own thread)
    assert prefetch_threads() == before


def test_the_planners_own_full_plan_is_cut_into_token_chunks_with_its_report(engine, store):
    request = stored_request(engine, store, RequestMode.AUTO)
    # a measured engine whose reuse is dear: laying out a reused token costs a second, a full prefill
    # a millisecond a hundred tokens, so the planner computes everything (a FULL plan)
    for n in (64, 128, 256):
        store.planner.observe(PrefillShape(n, n, 0, 0.0), n / 100_000)
    store.planner.observe(PrefillShape(256, 40, 200, 0.75), 200.0)
    num_parts, cut = run_steps(executor_for(engine, store), request)
    num_whole, whole = run_steps(executor_for(engine, store, chunk_tokens=100_000), request)
    n = len(whole.result.token_ids)
    assert cut.plan is not None and cut.plan.plan == "full" and whole.plan.plan == "full"
    assert num_whole == 0 and num_parts == -(-n // CHUNK_TOKENS) - 1
    assert cut.plan.num_chunks_recomputed == len(TOPICS) == whole.plan.num_chunks_recomputed
    assert len(cut.handles) == len(TOPICS)  # promoted after the answer, as a whole planned prefill's are
    a, b = cut.result, whole.result
    assert a.stats.mode is PrefillMode.FULL and a.stats.num_recomputed_tokens == n and a.token_ids == b.token_ids
    # token chunks: the same computation, GEMMs over other row counts (fp32 rounding)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-4)
    torch.testing.assert_close(a.cache.keys[:, :, :n], b.cache.keys[:, :, :n], rtol=0, atol=1e-4)
    torch.testing.assert_close(a.cache.values[:, :, :n], b.cache.values[:, :, :n], rtol=0, atol=1e-4)


def test_a_prompt_with_no_stored_kv_runs_as_a_full_prefill_in_mode_auto(engine, store):
    """Every chunk missed: mode auto computes the prompt as a full prefill (no selection over the prompt
    prefix's KV alone, no reused-attention scale on it), exactly what mode full computes; an explicit
    blend is honoured as asked."""
    request = stored_request(engine, store, RequestMode.AUTO)
    # keys never stored (the chunks behind another context): every handle misses
    missing = replace(request, chunks=tuple(PromptChunk(c.token_ids, store.key_for(c.token_ids, (7, 7)))
                                            for c in request.chunks))
    _, auto = run_steps(executor_for(engine, store), missing)
    _, full = run_steps(executor_for(engine, store), replace(request, mode=RequestMode.FULL))
    _, blend = run_steps(executor_for(engine, store), replace(missing, mode=RequestMode.BLEND))
    assert auto.handles == [] and auto.plan is None
    assert auto.result.stats.mode is PrefillMode.FULL and blend.result.stats.mode is PrefillMode.BLEND
    assert auto.result.token_ids == full.result.token_ids
    assert torch.equal(auto.result.logits, full.result.logits)


def test_the_engine_loop_closes_a_prefill_whose_client_left_between_its_parts(engine, store):
    """The loop runs one part a step; a background unit (one every step here) holds the loop between
    two parts while the client leaves; the next step drops the request and closes its prefill."""
    request = replace(stored_request(engine, store, RequestMode.BLEND), selection=SelectionKind.DEVIATION)
    loop = EngineLoop(engine, executor_for(engine, store), SchedulerConfig(background_every_steps=1))
    gate, held, released = threading.Event(), threading.Event(), threading.Event()
    before = prefetch_threads()

    def hold() -> None:  # on the loop's thread, after a step's prefill part
        held.set()
        released.wait(30)

    async def main():
        started = threading.Event()
        blocker = loop.submit(lambda job: (started.set(), gate.wait(30)))  # the request and the hold queue behind it
        assert await asyncio.to_thread(started.wait, 30)  # its step began: the hold runs in the request's first
        stream = loop.generate(request, time.perf_counter())
        assert loop.submit_background(hold)
        gate.set()
        await blocker.future
        assert await asyncio.to_thread(held.wait, 30)  # the first part ran; the hold runs after it
        assert loop.scheduler.num_prefilling == 1 and len(prefetch_threads()) == len(before) + 1
        stream.cancel()
        released.set()
        with pytest.raises(JobCancelled):
            await stream.job.future

    try:
        asyncio.run(main())
        # closed before the request's future was settled (the loop ends its stream just after)
        assert prefetch_threads() == before
    finally:
        released.set()
        assert loop.close()
    assert loop.stats.num_prefill_parts >= 1 and loop.stats.num_cancelled == 1 and loop.scheduler.num_running == 0


@pytest.mark.parametrize("mode", [RequestMode.BLEND, RequestMode.AUTO])
def test_a_deviation_ranking_reads_stored_kv_from_the_layer_it_checks(engine, store, monkeypatch, mode):
    """The configured check is layer 0 (the query ranking's); a request ranking by deviation checks at
    layer 1 (its K/V deviation is zero at layer 0). Everything keyed to the check layer follows the config
    the engine runs: the loader streams reused KV from layer 1, the planner plans and learns with layer 1
    (once they all read the unfitted layer 0 while the engine checked at 1)."""
    request = replace(stored_request(engine, store, mode), selection=SelectionKind.DEVIATION)
    executor = executor_for(engine, store)
    assert list(load_settings().blend.check_layers) == [0]
    start_layers, planned, observed = [], [], []
    layer_source, plan, observe = store.layer_source, store.plan, store.planner.observe
    monkeypatch.setattr(store, "layer_source", lambda *a, **kw: (start_layers.append(kw["start_layer"]),
                                                                 layer_source(*a, **kw))[1])
    monkeypatch.setattr(store, "plan", lambda req, **kw: (planned.append(req.first_reused_layer), plan(req, **kw))[1])
    monkeypatch.setattr(store.planner, "observe", lambda shape, s: (observed.append(shape), observe(shape, s))[1])
    _, outcome = run_steps(executor, request)
    assert outcome.result.stats.mode is PrefillMode.BLEND or mode is RequestMode.AUTO
    if outcome.result.stats.mode is PrefillMode.BLEND:
        assert start_layers == [1]
        layers = engine.num_layers
        assert observed[-1].reuse_fraction == (layers - 1) / layers  # blend reads reused KV from layer 1
    assert planned == ([1] if mode is RequestMode.AUTO else [])
