"""The prefix cache through the executor and the engine loop (runtime/executor.py), on the tiny fp32 model
against full-prefill references: a prompt kept whole answers with the logits and the greedy tokens of the
request that filled it, decoding never writes the kept KV, a chat's follow-up computes only its new
tokens (what a full prefill computes over the kept KV), a prompt sharing only the system prompt runs
today's plan, and what must stay apart (namespaces, prefills asked otherwise, an opted-out request) does."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
import torch

from blend_engine.engine import BlendEngine
from blend_engine.kv import PromptKV
from blend_engine.types import PrefillMode, SamplingParams, Segment, SelectionKind
from configs.enums import ChunkOrder, DecodeCache, RequestMode
from configs.settings import load_settings
from kv_store import KVStore, StoreConfig
from kv_store.planner import PrefillShape
from runtime.config import SchedulerConfig
from runtime.executor import PrefillExecutor, prefill_kind
from runtime.loop import EngineLoop
from runtime.types import DoneEvent, PrefillRequest, PromptChunk, TokenEvent

TOPICS = ["owls", "rivers", "copper", "violins"]
QUESTION = "What about owls and copper?"
ANSWER = "Owls hoot; copper conducts."
FOLLOW_UP = "And the rivers?"


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> BlendEngine:
    # fp32 on one fixed thread: the same ops give the same bits
    settings = load_settings(data_dir=tmp_path_factory.mktemp("prefix"),
                             model={"name": "random:tiny-llama", "device": "cpu", "weights": "fp32", "cpu_threads": 1})
    return BlendEngine.from_config(settings.model, settings.blend)


@pytest.fixture
def store(engine, monkeypatch):
    store = KVStore(engine.fingerprint, StoreConfig(disk_enabled=False, prefix_cache_bytes=1 << 30),
                    shape=engine.kv_shape)
    # a measured engine whose cost is its computed tokens (1 ms / 10 token-layers), reuse nearly free,
    # and no more learning from the prefills here: the planner's choices below follow from the shapes
    # alone, whatever the machine's load
    for n in (64, 128, 256):
        store.planner.observe(PrefillShape(n, n, 0, 0.0), n / 10_000)
    store.planner.observe(PrefillShape(256, 60, 200, 1.0), 60 / 10_000 + 200 / 1e6)
    monkeypatch.setattr(store.planner, "observe", lambda shape, seconds: None)
    yield store
    store.close()


def executor_for(engine, store, chunk_tokens: int = 16) -> PrefillExecutor:
    settings = load_settings()
    return PrefillExecutor(engine, store, settings.blend, settings.store.planner_profile_tokens, chunk_tokens,
                           prefix_cache=store.prompts)


def chunks_for(engine, store, topics=TOPICS) -> tuple[PromptChunk, ...]:
    sink = engine.sink_ids(load_settings().blend.sink)
    chunks = []
    for topic in topics:
        ids = tuple(engine.tokenize(" ".join(f"Fact {i} about {topic}: the {topic} number {i} is remarkable."
                                             for i in range(3))))
        key = store.key_for(ids, sink)
        store.put(key, engine.precompute(ids, sink))
        chunks.append(PromptChunk(ids, key))
    return tuple(chunks)


def request_for(engine, store, mode=RequestMode.BLEND, **changes) -> PrefillRequest:
    request = PrefillRequest(QUESTION, chunks_for(engine, store), mode, SamplingParams(max_tokens=6))
    return replace(request, **changes)


def follow_up(request: PrefillRequest, answer: str = ANSWER) -> PrefillRequest:
    history = (*request.history, {"role": "user", "content": request.question}, {"role": "assistant", "content": answer})
    return replace(request, question=FOLLOW_UP, history=history)


def run(executor, request):
    *parts, outcome = executor.prefill_steps(request)
    assert all(p is None for p in parts) and outcome is not None
    return outcome


def run_and_keep(executor, request):
    outcome = run(executor, request)
    assert executor.keep(outcome)
    return outcome


def greedy(engine, result, num_tokens: int = 8, cache_format: DecodeCache | None = None) -> list[int]:
    """Greedy tokens after the prompt, decoding over the result's cache (or a `cache_format` copy)."""
    decoder = engine.decoder(result, is_graphed=False, cache_format=cache_format)
    tokens = [int(result.logits.argmax())]
    for _ in range(num_tokens - 1):
        tokens.append(int(decoder.step(tokens[-1]).argmax()))
    return tokens


def test_a_prompt_kept_whole_answers_as_the_request_that_filled_it(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store)
    first = run_and_keep(executor, request)
    kept = PromptKV.of(first.result.cache, len(first.result.token_ids))
    n = kept.length
    before_keys, before_values = kept.keys[:, :, :n].clone(), kept.values[:, :, :n].clone()
    second = run(executor, request)
    a, b = first.result, second.result
    assert a.stats.mode is PrefillMode.BLEND and a.stats.num_prefix_cached_tokens == 0
    assert b.stats.num_prefix_cached_tokens == b.stats.num_prompt_tokens == n == len(b.token_ids)
    assert (b.stats.num_recomputed_tokens, b.stats.num_reused_tokens) == (0, 0)
    assert b.stats.mode is PrefillMode.BLEND and second.plan is None and second.keep is None
    assert b.token_ids == a.token_ids and torch.equal(b.logits, a.logits)
    assert b.cache.keys.data_ptr() == a.cache.keys.data_ptr()  # shared, nothing copied for the first token
    # greedy answers alike, the filler's decoding over its own cache first (it writes slots n.. of the
    # storage both share), then the second's (its first step copies the kept slots); none touches them
    tokens_a = greedy(engine, a)
    tokens_b = greedy(engine, b)
    assert tokens_a == tokens_b
    assert b.cache.keys.data_ptr() != a.cache.keys.data_ptr()  # copied on its first write
    assert torch.equal(kept.keys[:, :, :n], before_keys) and torch.equal(kept.values[:, :, :n], before_values)
    # a third, over an int8 decode copy (the CPU default with quantized weights): the same tokens again
    third = run(executor, request)
    assert greedy(engine, third.result, cache_format=DecodeCache.INT8) == \
        greedy(engine, run(executor_for(engine, store), replace(request, is_prefix_cache_used=False)).result,
               cache_format=DecodeCache.INT8)
    assert torch.equal(kept.keys[:, :, :n], before_keys)
    stats = store.prompts.stats()
    assert (stats.hits, stats.misses, stats.num_entries) == (2, 1, 1) and stats.tokens_served == 2 * n
    assert stats.bytes_used == kept.nbytes + a.logits.nbytes <= store.prompts.max_bytes


def test_a_follow_up_computes_only_its_new_tokens_over_the_kept_prompt(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store)
    first = run_and_keep(executor, request)
    n = len(first.result.token_ids)
    outcome = run(executor, follow_up(request))
    result = outcome.result
    assert result.token_ids[:n] == first.result.token_ids and len(result.token_ids) > n
    assert outcome.plan is not None and outcome.plan.plan == "prefix_cache"
    assert len(outcome.handles) == len(TOPICS)  # opened for the planner: promoted and let go after the answer
    assert result.stats.num_prefix_cached_tokens == n
    assert result.stats.num_recomputed_tokens == len(result.token_ids) - n and result.stats.num_reused_tokens == 0
    # the reference: the new tokens fed in one go over the first request's own cache
    first.result.cache.truncate(n)
    reference = engine.forward_tokens(first.result, result.token_ids[n:])[-1]
    torch.testing.assert_close(result.logits, reference, rtol=0, atol=1e-4)
    m = len(result.token_ids)
    torch.testing.assert_close(result.cache.keys[:, :, :m], first.result.cache.keys[:, :, :m], rtol=0, atol=1e-4)
    # it is kept in turn (the blend's kind): the next turn begins with it
    assert outcome.keep is not None and outcome.keep.kind == "blend/None/None" and executor.keep(outcome)
    third = run(executor, follow_up(follow_up(request), "The rivers flow."))
    assert third.result.stats.num_prefix_cached_tokens == m


def test_a_new_question_over_the_same_passages_reuses_them_and_computes_the_question(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store)
    first = run_and_keep(executor, request)
    outcome = run(executor, replace(request, question="Which facts are remarkable?"))
    num_shared = next(i for i, (a, b) in enumerate(zip(first.result.token_ids, outcome.result.token_ids)) if a != b)
    assert outcome.plan.plan == "prefix_cache" and outcome.result.stats.num_prefix_cached_tokens == num_shared
    assert num_shared > sum(len(c.token_ids) for c in request.chunks)  # the documents, then "Question: "


def test_a_follow_up_over_a_full_prefill_equals_a_full_prefill_of_the_whole(engine, store):
    """Kept exactly (mode full), a prompt plus the rest fed over it is a full prefill of the whole."""
    executor = executor_for(engine, store, chunk_tokens=10_000)
    request = request_for(engine, store, RequestMode.FULL)
    first = run_and_keep(executor, request)
    assert first.keep.kind == prefill_kind(request) == "full/None/None"
    outcome = run(executor, follow_up(request))
    result = outcome.result
    assert result.stats.num_prefix_cached_tokens == len(first.result.token_ids) and result.stats.mode is PrefillMode.FULL
    full = engine.prefill([Segment(tuple(result.token_ids))], mode=PrefillMode.FULL)
    torch.testing.assert_close(result.logits, full.logits, rtol=0, atol=1e-4)
    m = len(result.token_ids)
    torch.testing.assert_close(result.cache.keys[:, :, :m], full.cache.keys[:, :, :m], rtol=0, atol=1e-4)
    torch.testing.assert_close(result.cache.values[:, :, :m], full.cache.values[:, :, :m], rtol=0, atol=1e-4)


def test_a_prompt_sharing_only_the_system_prompt_runs_todays_plan(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store)
    run_and_keep(executor, request)
    other = replace(request, chunks=tuple(reversed(request.chunks)))  # the same passages, another order
    match = store.prompts.lookup("", ["blend/None/None"], [t for s in engine.prompts.segments(
        other.question, [Segment(c.token_ids) for c in other.chunks]) for t in s.token_ids])
    assert match is not None and 0 < match.num_tokens < 40  # the chat header and system prompt
    outcome = run(executor, other)
    assert outcome.plan is None and outcome.result.stats.mode is PrefillMode.BLEND
    assert outcome.result.stats.num_prefix_cached_tokens == 0 and outcome.result.stats.num_reused_tokens > 0
    assert store.prompts.stats().misses == 2


def test_what_must_stay_apart_does(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store, namespace="kb-a")
    run_and_keep(executor, request)
    assert run(executor, replace(request, namespace="kb-b")).result.stats.num_prefix_cached_tokens == 0
    # a prompt serves requests asking the same prefill only: a full prefill never reuses a blend's KV,
    # nor a blend a full prefill's, nor a blend at another ratio or selection the default blend's
    full = run(executor, replace(request, mode=RequestMode.FULL))
    assert full.result.stats.num_prefix_cached_tokens == 0 and full.keep.kind == "full/None/None"
    assert executor.keep(full)
    assert run(executor, replace(request, mode=RequestMode.FULL)).result.stats.num_prefix_cached_tokens > 0
    again = run(executor, request)
    assert again.result.stats.num_prefix_cached_tokens == len(again.result.token_ids)
    assert again.result.stats.mode is PrefillMode.BLEND and not torch.equal(again.result.logits, full.result.logits)
    for other in (replace(request, recompute_ratio=0.5), replace(request, selection=SelectionKind.DEVIATION),
                  replace(request, mode=RequestMode.AUTO)):
        asked = run(executor, other)
        assert asked.result.stats.num_prefix_cached_tokens == 0 and asked.keep.kind == prefill_kind(other)
    # opted out: neither read nor filled
    alone = run(executor, replace(request, is_prefix_cache_used=False))
    assert alone.result.stats.num_prefix_cached_tokens == 0 and alone.keep is None
    # a chunk without a stored key: its prompt could not be dropped with its document, so it is not kept
    unkeyed = replace(request, chunks=(PromptChunk(request.chunks[0].token_ids, None), *request.chunks[1:]))
    assert run(executor, unkeyed).keep is None


def test_a_changed_document_drops_the_prompts_holding_its_chunks(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store)
    run_and_keep(executor, request)
    assert store.prompts.invalidate_chunks({request.chunks[2].kv_key}) == 1
    assert run(executor, request).result.stats.num_prefix_cached_tokens == 0


def test_the_engine_loop_answers_a_repeated_request_with_the_same_tokens(engine, store):
    """Twice in a row: identical tokens, the usage shows the tokens served from the prefix cache. Then
    again while the first decodes other tokens (sampled) into the storage past the prompt that the second
    shares: the second's greedy tokens are those of the same request with the prefix cache off."""
    loop = EngineLoop(engine, executor_for(engine, store), SchedulerConfig())
    request = request_for(engine, store, sampling=SamplingParams(max_tokens=24, is_eos_ignored=True))
    other = replace(request, chunks=tuple(reversed(request.chunks)))  # shares only the system prompt
    sampled = replace(other, sampling=SamplingParams(max_tokens=24, is_eos_ignored=True, temperature=1.0, seed=3))

    async def answer(req, first_token: asyncio.Event | None = None):
        tokens, done = [], None
        async for event in loop.generate(req, time.perf_counter()):
            if isinstance(event, TokenEvent):
                tokens.append(event.text)
                if first_token is not None:
                    first_token.set()
            elif isinstance(event, DoneEvent):
                done = event
        return tokens, done

    async def main():
        first = await answer(request)
        second = await answer(request)
        started = asyncio.Event()
        running = asyncio.create_task(answer(sampled, started))
        await started.wait()  # decoding now; the same prompt comes in, greedy
        beside = await answer(other)
        reference = await answer(replace(other, is_prefix_cache_used=False))
        return first, second, await running, beside, reference

    try:
        results = asyncio.run(main())
    finally:
        assert loop.close()
    (tokens_1, done_1), (tokens_2, done_2), (tokens_3, done_3), (tokens_4, done_4), (tokens_5, _) = results
    assert done_1.usage.prefix_cached_tokens == 0 and done_1.usage.recomputed_tokens > 0
    assert done_2.usage.prefix_cached_tokens == done_2.usage.prompt_tokens == done_1.usage.prompt_tokens
    assert (done_2.usage.reused_tokens, done_2.usage.recomputed_tokens) == (0, 0)
    assert tokens_2 == tokens_1 and done_2.usage.completion_tokens == 24
    assert done_3.usage.prefix_cached_tokens == 0 and done_4.usage.prefix_cached_tokens == done_4.usage.prompt_tokens
    assert tokens_4 == tokens_5 != tokens_3 and done_4.usage.completion_tokens == 24


def test_a_prompt_kept_over_another_holds_its_own_chunks_only(engine, store, monkeypatch):
    """A prompt computed over a kept prefix of another (here only its first chunk in common) is dropped
    with its own chunks' documents, not with the other's. The chunks in the best-first order: by default
    the best ranked comes last, so prompts over different chunk lists share no more than the system part."""
    monkeypatch.setattr(engine.prompts, "chunk_order", ChunkOrder.BEST_FIRST)
    executor = executor_for(engine, store)
    request = request_for(engine, store)
    run_and_keep(executor, request)
    shorter = replace(request, chunks=request.chunks[:1])
    outcome = run(executor, shorter)
    assert outcome.plan.plan == "prefix_cache" and outcome.keep.chunk_keys == {request.chunks[0].kv_key}
    assert executor.keep(outcome)
    assert store.prompts.invalidate_chunks({request.chunks[3].kv_key}) == 1  # the first prompt only
    assert run(executor, shorter).result.stats.num_prefix_cached_tokens == len(outcome.result.token_ids)


def test_a_prompt_whose_document_changed_after_its_chunks_were_chosen_is_not_kept(engine, store):
    executor = executor_for(engine, store)
    request = request_for(engine, store, prefix_cache_epoch=store.prompts.epoch)  # retrieval's moment
    store.prompts.invalidate_chunks({request.chunks[1].kv_key})  # the document changes meanwhile
    outcome = run(executor, request)
    assert outcome.keep is not None and not executor.keep(outcome) and len(store.prompts) == 0
    assert executor.keep(run(executor, replace(request, prefix_cache_epoch=None)))  # chosen now: kept
