"""Continuous batching on a live server (tiny random model, real HTTP for ingestion, the server's own
pipeline and engine loop for the answers): answers in a batch equal the same requests alone; a new
request does not wait for a running answer; a client that leaves is dropped from the batch; a long
full prefill cut into chunks answers like one prefill; a running answer decodes between the parts of
another request's long blend prefill (or, with a stall bound, waits while its parts run back to back);
an upload's precompute interleaves with a running answer
instead of holding it."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import replace

import httpx
import pytest
import torch

from app.rag.types import DoneEvent, RagRequest, TokenEvent
from app.testing import LiveServer
from blend_engine.types import FinishReason, PrefillMode, SamplingParams
from configs.enums import RequestMode
from configs.settings import load_settings
from runtime.jobs import JobCancelled
from runtime.types import PrefillRequest

# every retrieved chunk reaches the prompt (no relevance floor): these tests size prompts by top_k
NO_FLOOR = {"chunk_tokens": 24, "chunk_overlap": 0, "min_score": -1.0, "score_margin": 2.0}
TOPICS = ["owls", "rivers", "copper", "violins", "glaciers", "tea", "bridges", "comets"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(
        data_dir=tmp_path_factory.mktemp("batching"), model={"name": "random:tiny-llama", "device": "cpu"},
        retrieval=NO_FLOOR,
        # 0: a decode step after every step, so that running answers decode between another's parts
        scheduler={"max_running": 8, "prefill_chunk_tokens": 64, "max_decode_stall_ms": 0},
        # the prefix cache off: these tests ask the same requests again (alone, then in a batch) and count
        # their prefills' parts (tests/test_prefix_executor.py: a kept prompt beside a running answer)
        store={"prefix_cache_bytes": 0},
    )
    docs = [{"id": t, "text": " ".join(f"Fact {i} about {t}: the {t} number {i} is remarkable." for i in range(6))}
            for t in TOPICS]
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        assert http.post("/v1/documents", json={"documents": docs}).status_code == 201
        yield live


def rag_request(question: str, mode: RequestMode, max_tokens: int, top_k: int = 3, **sampling) -> RagRequest:
    """The server's default retrieval. (An answer alone on cold KV once differed from the same request in
    a batch on warm KV: a low-bit layer read from disk was not rounded as its promoted memory copy is;
    tests/test_kv_transfer.py holds the tiers equal now.)"""
    return RagRequest(question=question, mode=mode, sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                      top_k=top_k)


async def answer(pipeline, request: RagRequest, on_token=None) -> tuple[str, DoneEvent]:
    context = await pipeline.retrieve(request)
    stream = pipeline.start(request, context, time.perf_counter())
    pieces, done = [], None
    async for event in stream:
        if isinstance(event, TokenEvent):
            pieces.append(event.text)
            if on_token is not None:
                on_token(len(pieces))
        else:
            done = event
    return "".join(pieces), done


def batch_sizes(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'ragblend_engine_batch_size_bucket\{le="([^"]+)"\} (\S+)', text)}


MIXED = [
    ("Tell me about owls.", RequestMode.BLEND, 20, {}),
    ("What about rivers and copper?", RequestMode.FULL, 12, {}),
    ("Glaciers?", RequestMode.REUSE, 16, {}),
    ("Comets and tea, please.", RequestMode.BLEND, 8, {"temperature": 0.8, "seed": 7}),
    ("Violins or bridges?", RequestMode.PREFIX, 14, {}),
]


def test_answers_in_a_batch_equal_the_same_requests_alone(server):
    pipeline = server.components.pipeline
    requests = [rag_request(q, mode, n, **sampling) for q, mode, n, sampling in MIXED]

    async def alone():
        return [await answer(pipeline, r) for r in requests]

    async def together():
        return await asyncio.gather(*(answer(pipeline, r) for r in requests))

    before = batch_sizes(server)
    solo, batched = asyncio.run(alone()), asyncio.run(together())
    after = batch_sizes(server)
    for (text_a, done_a), (text_b, done_b) in zip(solo, batched):
        assert text_a == text_b and done_a.usage == done_b.usage and done_a.finish_reason == done_b.finish_reason
    num_steps = after["+Inf"] - before["+Inf"]
    num_single = after["1.0"] - before["1.0"]
    assert num_steps - num_single > 0, "no decode step ran more than one sequence"


def test_a_new_request_does_not_wait_for_a_running_answer(server):
    pipeline = server.components.pipeline
    order = []

    async def main():
        first_token = asyncio.Event()
        long = asyncio.create_task(answer(pipeline, rag_request("Owls and rivers.", RequestMode.BLEND, 300),
                                          on_token=lambda n: first_token.set()))
        await first_token.wait()
        short_text, short_done = await answer(pipeline, rag_request("Tea?", RequestMode.BLEND, 3))
        order.append(("short", long.done()))
        long_text, long_done = await long
        return short_done, long_done

    short_done, long_done = asyncio.run(main())
    assert long_done.finish_reason is FinishReason.LENGTH  # it really ran 300 tokens
    assert order == [("short", False)]  # the short answer ended while the long one was running
    assert short_done.timings.queue_ms < long_done.timings.total_ms / 4


def test_a_client_that_leaves_is_dropped_from_the_batch(server):
    loop = server.components.loop
    pipeline = server.components.pipeline

    async def main():
        request = rag_request("Copper and comets.", RequestMode.BLEND, 400)
        context = await pipeline.retrieve(request)
        stream = pipeline.start(request, context, time.perf_counter())
        other = asyncio.create_task(answer(pipeline, rag_request("Bridges.", RequestMode.BLEND, 40)))
        async for event in stream:
            break  # the client goes away after its first piece
        stream.cancel()
        with pytest.raises(JobCancelled):
            await stream.job.future
        return await other

    cancelled_before = loop.stats.num_cancelled
    text, done = asyncio.run(main())
    assert done.usage.completion_tokens > 0
    assert loop.stats.num_cancelled == cancelled_before + 1
    deadline = time.monotonic() + 5
    while loop.num_running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.num_running == 0


def test_a_long_full_prefill_in_chunks_answers_like_one_prefill(server):
    components = server.components
    chunks = [c for c in components.retriever.store.get_document("owls").chunks]
    chunks += components.retriever.store.get_document("rivers").chunks
    from runtime.types import PromptChunk
    request = PrefillRequest("Owls?", tuple(PromptChunk(tuple(c.token_ids), c.kv_key) for c in chunks),
                             RequestMode.FULL, SamplingParams(max_tokens=4))

    def run(executor):
        steps = list(executor.prefill_steps(request))
        return len(steps), steps[-1].result

    # run on the engine loop, as the server does (nothing else uses the engine meanwhile)
    async def on_loop(fn):
        return await components.loop.run(lambda job: fn())

    chunked = replace(components.executor, prefill_chunk_tokens=16)
    whole = replace(components.executor, prefill_chunk_tokens=100_000)
    num_chunked, a = asyncio.run(on_loop(lambda: run(chunked)))
    num_whole, b = asyncio.run(on_loop(lambda: run(whole)))
    n = len(b.token_ids)
    assert num_whole == 1 and num_chunked == -(-n // 16) and a.token_ids == b.token_ids
    # the server's default int4 weights multiply in bf16 (~3 significant digits), and a GEMM over 16
    # rows rounds otherwise than one over the whole prompt: equal to that precision, same argmax
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-2)
    assert int(a.logits.argmax()) == int(b.logits.argmax())
    torch.testing.assert_close(a.cache.keys[:, :, :n], b.cache.keys[:, :, :n], rtol=0, atol=2e-2)
    torch.testing.assert_close(a.cache.values[:, :, :n], b.cache.values[:, :, :n], rtol=0, atol=2e-2)


LONG_PROMPT_QUESTION = rag_request("Tell me everything.", RequestMode.BLEND, 3, top_k=16)
STAT_NAMES = ("num_prefill_parts", "num_decode_steps_mid_prefill", "num_decode_steps_deferred")


def answer_beside_a_running_one(loop, pipeline, question: RagRequest):
    """`question` answered while a 600-token answer runs: its text and DoneEvent, the running answer's
    DoneEvent, how much each loop counter of STAT_NAMES grew meanwhile, and whether the running answer
    was still running when `question`'s ended."""
    async def main():
        first_token = asyncio.Event()
        long = asyncio.create_task(answer(pipeline, rag_request("Owls and rivers.", RequestMode.BLEND, 600),
                                          on_token=lambda n: first_token.set()))
        await first_token.wait()
        before = {name: getattr(loop.stats, name) for name in STAT_NAMES}
        text, done = await answer(pipeline, question)
        grown = {name: getattr(loop.stats, name) - before[name] for name in STAT_NAMES}
        is_long_running = not long.done()
        return text, done, (await long)[1], grown, is_long_running

    return asyncio.run(main())


def test_a_running_answer_streams_between_the_parts_of_a_long_blend_prefill(server):
    loop, pipeline = server.components.loop, server.components.pipeline
    # 16 chunks of 24 tokens: ~400 tokens, past the 64 x 4 token-layers one part may run
    _, done, long_done, grown, is_long_running = answer_beside_a_running_one(loop, pipeline, LONG_PROMPT_QUESTION)
    assert done.mode is PrefillMode.BLEND and done.usage.prompt_tokens > 64 * 4
    assert long_done.finish_reason is FinishReason.LENGTH and is_long_running
    # each part but the last handed its step back, and the running answer decoded a token in it
    parts, mid = grown["num_prefill_parts"], grown["num_decode_steps_mid_prefill"]
    assert parts >= 1 and mid == parts, grown
    text = httpx.get(f"{server.url}/metrics").text  # the same counters, for an operator
    exported = {name: float(re.search(rf"^{name}_total (\S+)$", text, re.M).group(1))
                for name in ("ragblend_engine_prefill_parts", "ragblend_engine_decode_steps_mid_prefill")}
    assert exported == {"ragblend_engine_prefill_parts": loop.stats.num_prefill_parts,
                        "ragblend_engine_decode_steps_mid_prefill": loop.stats.num_decode_steps_mid_prefill}


def test_with_a_stall_bound_a_long_prefill_runs_its_parts_back_to_back(server):
    """`scheduler.max_decode_stall_ms`: while a prefill runs in parts, the running answer's decode step
    waits (here the bound is far off: no decode step between the parts at all); the answer then goes
    on, and the new one is what it is alone."""
    loop, pipeline = server.components.loop, server.components.pipeline
    config = loop.scheduler.config
    loop.scheduler.config = replace(config, max_decode_stall_ms=600_000)
    try:
        text, done, long_done, grown, is_long_running = answer_beside_a_running_one(
            loop, pipeline, LONG_PROMPT_QUESTION)
    finally:
        loop.scheduler.config = config
    assert done.usage.prompt_tokens > 64 * 4 and long_done.finish_reason is FinishReason.LENGTH
    assert is_long_running
    # every part ran without the running answer's decode step after it (the last one included)
    parts = grown["num_prefill_parts"]
    assert parts >= 1 and grown["num_decode_steps_mid_prefill"] == 0, grown
    assert grown["num_decode_steps_deferred"] == parts + 1, grown
    assert text == asyncio.run(answer(pipeline, LONG_PROMPT_QUESTION))[0]  # alone, nothing running
    assert re.search(r"^ragblend_engine_decode_steps_deferred_total (\S+)$", httpx.get(f"{server.url}/metrics").text,
                     re.M).group(1) == str(float(loop.stats.num_decode_steps_deferred))


def test_an_upload_interleaves_with_a_running_answer(server):
    pipeline = server.components.pipeline
    ingest_window = {}

    def ingest():
        docs = [{"id": f"bulk-{i}", "text": " ".join(f"Bulk note {i}.{j} on lanterns and maps." for j in range(40))}
                for i in range(4)]
        ingest_window["start"] = time.perf_counter()
        response = httpx.post(f"{server.url}/v1/documents", json={"documents": docs}, timeout=120)
        ingest_window["end"] = time.perf_counter()
        ingest_window["status"] = response.status_code

    token_times = []

    async def main():
        started = asyncio.Event()

        def on_token(n):
            token_times.append(time.perf_counter())
            started.set()

        task = asyncio.create_task(answer(pipeline, rag_request("Tea and owls.", RequestMode.BLEND, 600),
                                          on_token=on_token))
        await started.wait()
        thread = threading.Thread(target=ingest)
        thread.start()
        result = await task
        await asyncio.to_thread(thread.join)
        return result

    text, done = asyncio.run(main())
    assert ingest_window["status"] == 201
    during = [t for t in token_times if ingest_window["start"] < t < ingest_window["end"]]
    assert during, "no token streamed while the upload was being ingested"
    assert done.finish_reason is FinishReason.LENGTH or token_times[-1] > ingest_window["start"]


def test_a_question_waits_through_one_background_unit_at_most(tmp_path):
    """An upload costs a waiting question one chunk's precompute at most (issue 23): with answers one at a
    time, background units queued and the lane paced every busy step, each answer's `background_ms` is
    one unit's time or none, though the 4 questions together waited through many steps."""
    settings = load_settings(data_dir=tmp_path, model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval=NO_FLOOR,
                             scheduler={"max_running": 1, "background_every_steps": 1})
    unit_s = 0.15
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        docs = [{"id": t, "text": f"The {t} are remarkable in many ways."} for t in TOPICS[:4]]
        assert http.post("/v1/documents", json={"documents": docs}).status_code == 201
        pipeline, loop = live.components.pipeline, live.components.loop
        units_run = []

        def unit():
            time.sleep(unit_s)
            units_run.append(time.perf_counter())

        async def main():
            requests = [rag_request(f"About {t}?", RequestMode.BLEND, 12, top_k=1) for t in TOPICS[:4]]
            for _ in range(20):
                assert loop.submit_background(unit)
            return await asyncio.gather(*(answer(pipeline, r) for r in requests))

        results = asyncio.run(main())
    waited = [done.timings.background_ms for _, done in results]
    assert len(units_run) >= 2  # the lane ran while answers were being served: not starved
    assert any(ms > 0 for ms in waited)
    assert all(ms < 2 * unit_s * 1000 for ms in waited), waited  # never two units before a first token


def test_a_delete_of_no_such_document_is_a_404_not_an_engine_failure(server, caplog):
    loop = server.components.loop
    before = (loop.stats.num_failed, loop.stats.num_completed)
    with caplog.at_level("ERROR"):
        response = httpx.delete(f"{server.url}/v1/documents/no-such-document", timeout=30)
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert (loop.stats.num_failed, loop.stats.num_completed) == before  # writes do not run on the engine loop
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_close_ends_every_sequence_and_write_cleanly(tmp_path):
    settings = load_settings(data_dir=tmp_path, model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval=NO_FLOOR)
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.post("/v1/documents", json={"documents": [{"id": "a", "text": "Owls hunt at night."}]}
                         ).status_code == 201
        components = live.components
        pipeline, loop = components.pipeline, components.loop
        outcomes = []

        async def main():
            started: set[int] = set()
            running = [asyncio.create_task(answer(pipeline, rag_request(f"Owls {i}?", RequestMode.BLEND, 5000),
                                                  on_token=lambda n, i=i: started.add(i))) for i in range(3)]
            while len(started) < 3:  # all three are decoding
                await asyncio.sleep(0.01)
            # a write waiting on the engine loop for a chunk's KV: it must be released too
            blocked = asyncio.create_task(asyncio.to_thread(
                loop.call_background, lambda: time.sleep(0.2)))
            t_close = time.perf_counter()
            assert await asyncio.to_thread(components.loop.close, 30.0) is True
            outcomes.append(time.perf_counter() - t_close)
            for task in [*running, blocked]:
                try:
                    await task
                    outcomes.append("finished")
                except JobCancelled:
                    outcomes.append("cancelled")

        asyncio.run(main())
        assert outcomes[0] < 5.0  # the loop stopped at its next step, not after 5000 tokens
        assert outcomes[1:4] == ["cancelled"] * 3 and outcomes[4] in ("finished", "cancelled")
        assert loop.num_running == 0 and loop.num_waiting == 0
