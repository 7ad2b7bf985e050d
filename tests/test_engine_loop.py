"""The engine loop's jobs: one exclusive job at a time, a bounded queue (503), cancellation between
steps, background units only when nothing waits, a clean close. Its generations (a tiny random model):
every way one leaves the loop (its answer done at its first token or later, its client gone while
queued, between two prefill parts or decoding, a failure in a prefill part or a decode step,
shutdown) ends its stream; several long prefills admitted in one step all answer. (Generations in the
batch: tests/test_scheduler.py and tests/test_server_batching.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

from dataclasses import replace

import pytest

from blend_engine.engine import BlendEngine
from blend_engine.types import FinishReason, SamplingParams
from configs.enums import KVQuantization, RequestMode, StorageDtype
from configs.settings import load_settings
from kv_store import KVStore, StoreConfig, Tier
from runtime.config import SchedulerConfig
from runtime.executor import PrefillExecutor
from runtime.jobs import JobCancelled, QueueFull
from runtime.loop import EngineLoop
from runtime.types import DoneEvent, PrefillRequest, PromptChunk, TokenEvent


def EngineWorker(max_queue: int, retry_after_s: int = 2, max_background: int = 64) -> EngineLoop:
    """A loop that runs jobs only (no engine): what the old one-job-at-a-time worker was."""
    return EngineLoop(None, None, SchedulerConfig(max_queue=max_queue, retry_after_s=retry_after_s,
                                                  max_background=max_background))


def test_jobs_run_one_at_a_time_and_failures_reach_the_caller():
    async def main():
        worker = EngineWorker(max_queue=8)
        active, peak = [0], [0]

        def job(_):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            time.sleep(0.02)
            active[0] -= 1
            return threading.current_thread().name

        try:
            names = await asyncio.gather(*(worker.run(job) for _ in range(5)))
            assert set(names) == {"engine-loop"} and peak[0] == 1

            def boom(_):
                raise ValueError("bad job")

            with pytest.raises(ValueError, match="bad job"):
                await worker.run(boom)
            assert worker.stats.num_completed == 5 and worker.stats.num_failed == 1
            deadline = time.monotonic() + 5  # the metrics' busy gauge: idle again once the step is reported
            while worker.is_busy and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not worker.is_busy
        finally:
            worker.close()

    asyncio.run(main())


def test_a_full_queue_is_rejected_with_retry_after():
    async def main():
        worker = EngineWorker(max_queue=1, retry_after_s=7)
        release = threading.Event()
        try:
            running = worker.submit(lambda job: release.wait(5))
            await asyncio.sleep(0.1)  # the first job is running; the queue is empty
            waiting = worker.submit(lambda job: "second")
            with pytest.raises(QueueFull) as error:
                worker.submit(lambda job: "third")
            assert error.value.retry_after_s == 7
            release.set()
            assert await running.future is True and await waiting.future == "second"
        finally:
            worker.close()

    asyncio.run(main())


def test_leaving_a_stream_cancels_its_job_and_frees_the_worker():
    async def main():
        worker = EngineWorker(max_queue=4)
        steps = []

        def generate(job, emit):
            for i in range(1000):
                job.check()
                steps.append(i)
                emit(i)
                time.sleep(0.005)

        try:
            stream = worker.stream(generate)
            async for item in stream:
                if item == 3:
                    break
            stream.cancel()
            assert await worker.run(lambda job: "next") == "next"  # the worker is free again
            assert len(steps) < 100 and worker.stats.num_cancelled == 1
            with pytest.raises(JobCancelled):
                await stream.job.future
        finally:
            worker.close()

    asyncio.run(main())


def test_background_tasks_run_only_when_no_job_waits_and_are_bounded():
    async def main():
        worker = EngineWorker(max_queue=8, max_background=2)
        order, release = [], threading.Event()
        try:
            first = worker.submit(lambda job: release.wait(5))
            await asyncio.sleep(0.05)  # the first job runs: everything below waits
            assert worker.submit_background(lambda: order.append("repair-1"))
            assert worker.submit_background(lambda: order.append("repair-2"))
            assert not worker.submit_background(lambda: order.append("repair-3"))  # bounded: dropped
            second = worker.submit(lambda job: order.append("job"))
            release.set()
            await first.future
            await second.future
            deadline = time.monotonic() + 5
            while len(order) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert order == ["job", "repair-1", "repair-2"]  # the request's job went first
        finally:
            worker.close()

    asyncio.run(main())


def test_close_stops_the_running_job_and_waits_for_it():
    async def main():
        worker = EngineWorker(max_queue=4)
        steps, finished = [], threading.Event()

        def ingest(job):
            try:
                for i in range(1000):
                    job.check()  # between documents
                    steps.append(i)
                    time.sleep(0.01)
            finally:
                finished.set()  # e.g. the index saved: before the stores may close

        running = worker.submit(ingest)
        queued = worker.submit(lambda job: "never")
        await asyncio.sleep(0.1)
        assert await asyncio.to_thread(worker.close) is True
        assert finished.is_set() and len(steps) < 100
        with pytest.raises(JobCancelled):
            await running.future
        with pytest.raises(JobCancelled):
            await queued.future
        assert not worker.submit_background(lambda: None)

    asyncio.run(main())


def test_components_close_the_stores_only_after_the_loop_and_the_writes_stopped():
    from app.components import Components

    closed = []

    class Part:
        def __init__(self, name, stops=True):
            self.name, self.stops = name, stops

        def close(self):
            closed.append(self.name)
            return self.stops

    class Writes(Part):
        def close(self, timeout_s):
            return super().close()

    for stops, expected in ((True, ["loop", "writes", "kv_store", "retriever"]), (False, ["loop", "writes"])):
        closed.clear()
        components = object.__new__(Components)
        components.loop, components.kv_store = Part("loop", stops), Part("kv_store")
        components.documents = type("Docs", (), {"writes": Writes("writes")})()
        components.retriever = Part("retriever")
        components.close()
        assert closed == expected


def test_a_stream_cancelled_while_queued_ends_instead_of_waiting_for_ever():
    """The shutdown hang's cause: a stream job cancelled before it starts never runs its body (which
    emits the stream's end), so its reader (a non-streaming request collecting the answer) waited for
    ever. The stream ends, raising JobCancelled, once the worker skips the job."""
    async def main():
        worker = EngineWorker(max_queue=4)
        release = threading.Event()
        try:
            running = worker.submit(lambda job: release.wait(5))
            stream = worker.stream(lambda job, emit: emit("never"))
            stream.cancel()  # the client left while the job was queued
            release.set()
            await running.future

            async def read():
                return [item async for item in stream]

            with pytest.raises(JobCancelled):
                await asyncio.wait_for(read(), timeout=10)
            assert worker.stats.num_cancelled == 1
        finally:
            worker.close()

    asyncio.run(main())


# --- generations --------------------------------------------------------------------------------
CHUNK_TOKENS = 16  # the executor's prefill_chunk_tokens: every prompt below runs in parts, in any mode
TOPICS = ["owls", "rivers", "copper", "tea"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> BlendEngine:
    settings = load_settings(data_dir=tmp_path_factory.mktemp("loop"),
                             model={"name": "random:tiny-llama", "device": "cpu", "weights": "fp32", "cpu_threads": 1})
    return BlendEngine.from_config(settings.model, settings.blend)


@pytest.fixture(scope="module")
def chunks(engine, tmp_path_factory):
    """A store holding each topic's chunk (~40 tokens), and the chunks as a prompt holds them."""
    store = KVStore(engine.fingerprint, StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32,
                                                    fsync=False, disk_dir=tmp_path_factory.mktemp("kv"),
                                                    write_tiers=frozenset({Tier.MEMORY})), shape=engine.kv_shape)
    sink = engine.sink_ids(load_settings().blend.sink)
    prompt_chunks = []
    for topic in TOPICS:
        ids = tuple(engine.tokenize(" ".join(f"Fact {i} about {topic}: the {topic} number {i} is remarkable."
                                             for i in range(3))))
        key = store.key_for(ids, sink)
        store.put(key, engine.precompute(ids, sink))
        prompt_chunks.append(PromptChunk(ids, key))
    yield store, prompt_chunks
    store.close()


def generation_loop(engine, chunks, **config) -> EngineLoop:
    settings = load_settings()
    executor = PrefillExecutor(engine, chunks[0], settings.blend, settings.store.planner_profile_tokens, CHUNK_TOKENS)
    return EngineLoop(engine, executor, SchedulerConfig(**config))


def ask(chunks, num_chunks: int = 2, mode: RequestMode = RequestMode.FULL, max_tokens: int = 4) -> PrefillRequest:
    return PrefillRequest("What about them?", tuple(chunks[1][:num_chunks]), mode, SamplingParams(max_tokens=max_tokens))


async def ending(stream, timeout_s: float = 60) -> tuple[list, BaseException | None]:
    """What a stream gave, and the error it ended with (None: it ended cleanly); a TimeoutError, failing
    the test, when it never ends."""
    events: list = []

    async def read() -> BaseException | None:
        try:
            async for event in stream:
                events.append(event)
        except Exception as exc:
            return exc
        return None

    return events, await asyncio.wait_for(read(), timeout_s)


async def held_loop(loop) -> tuple[threading.Event, asyncio.Future]:
    """The loop running a job that waits for the returned gate: what is queued now is scheduled together
    once the gate opens (the job already has its step: nothing queued now runs beside it)."""
    started, gate = threading.Event(), threading.Event()
    job = loop.submit(lambda job: (started.set(), gate.wait(30)))
    assert await asyncio.to_thread(started.wait, 30)
    return gate, job.future


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


@pytest.mark.parametrize("mode", [RequestMode.FULL, RequestMode.BLEND])
def test_long_prefills_admitted_in_one_step_all_answer(engine, chunks, mode):
    """The hang (the third of three long prompts never answered, the loop idle): prefills in parts
    admitted in one step (a full one in token chunks, a blend by layers) each go on, a part a step,
    and answer what they answer alone."""
    loop = generation_loop(engine, chunks)
    requests = [ask(chunks, n, mode) for n in (2, 3, 4)]

    async def main():
        gate, blocker = await held_loop(loop)
        streams = [loop.generate(r, time.perf_counter()) for r in requests]
        gate.set()
        await blocker
        together = await asyncio.gather(*(ending(s) for s in streams))
        num_parts = loop.stats.num_prefill_parts
        alone = [await ending(loop.generate(r, time.perf_counter())) for r in requests]
        return together, num_parts, alone

    try:
        together, num_parts, alone = asyncio.run(main())
    finally:
        assert loop.close()
    assert num_parts >= len(requests) and loop.stats.num_prefill_parts == 2 * num_parts  # each ran in parts
    for (events, error), (alone_events, _) in zip(together, alone):
        assert error is None and isinstance(events[-1], DoneEvent), (events, error)
        assert events[-1].usage == alone_events[-1].usage and text_of(events) == text_of(alone_events)
    assert loop.num_waiting == loop.num_running == 0
    assert (loop.stats.num_completed, loop.stats.num_failed, loop.stats.num_cancelled) == (7, 0, 0)


async def finished_at_its_first_token(loop, engine, chunks, monkeypatch):
    monkeypatch.setattr(engine, "eos_ids", frozenset(range(engine.model.config.vocab_size)))  # whatever it samples
    events, error = await ending(loop.generate(ask(chunks, max_tokens=50), time.perf_counter()))
    assert error is None and events[-1].finish_reason is FinishReason.STOP and events[-1].usage.completion_tokens == 1
    return "completed"


async def finished_by_its_length(loop, engine, chunks, monkeypatch):
    events, error = await ending(loop.generate(ask(chunks, max_tokens=6), time.perf_counter()))
    assert error is None and events[-1].finish_reason is FinishReason.LENGTH and events[-1].usage.completion_tokens == 6
    return "completed"


async def cancelled_while_waiting(loop, engine, chunks, monkeypatch):
    gate, blocker = await held_loop(loop)
    stream = loop.generate(ask(chunks), time.perf_counter())
    stream.cancel()
    gate.set()
    events, error = await ending(stream)
    assert events == [] and isinstance(error, JobCancelled)
    return "cancelled"


async def cancelled_between_prefill_parts(loop, engine, chunks, monkeypatch):
    held, release = threading.Event(), threading.Event()
    gate, blocker = await held_loop(loop)
    stream = loop.generate(ask(chunks), time.perf_counter())
    assert loop.submit_background(lambda: (held.set(), release.wait(30)))  # runs after the prefill's first part
    gate.set()
    assert await asyncio.to_thread(held.wait, 30)
    assert loop.stats.num_prefill_parts == 1 and loop.scheduler.num_prefilling == 1
    stream.cancel()
    release.set()
    events, error = await ending(stream)
    assert events == [] and isinstance(error, JobCancelled) and loop.stats.num_prefill_parts == 1
    return "cancelled"


async def cancelled_while_decoding(loop, engine, chunks, monkeypatch):
    stream = loop.generate(ask(chunks, max_tokens=3000), time.perf_counter())
    first = await asyncio.wait_for(anext(stream), 60)
    assert isinstance(first, TokenEvent)
    stream.cancel()
    events, error = await ending(stream)
    assert isinstance(error, JobCancelled) and not any(isinstance(e, DoneEvent) for e in events)
    return "cancelled"


async def failed_in_its_first_prefill_part(loop, engine, chunks, monkeypatch):
    too_long = ask(chunks, max_tokens=engine.max_context)  # the prompt and the answer exceed the context
    events, error = await ending(loop.generate(too_long, time.perf_counter()))
    assert events == [] and isinstance(error, ValueError) and "context" in str(error)
    return "failed"


async def failed_between_prefill_parts(loop, engine, chunks, monkeypatch):
    request = ask(chunks)
    bad = PromptChunk(request.chunks[-1].token_ids + (engine.model.config.vocab_size + 10,), None)  # no such token
    events, error = await ending(loop.generate(replace(request, chunks=(*request.chunks[:-1], bad)),
                                               time.perf_counter()))
    assert events == [] and isinstance(error, IndexError) and loop.stats.num_prefill_parts >= 1
    return "failed"


async def failed_in_a_decode_step(loop, engine, chunks, monkeypatch):
    def broken(sequences):
        raise RuntimeError("the decode step broke")

    monkeypatch.setattr(engine, "decode_step", broken)
    gate, blocker = await held_loop(loop)
    streams = [loop.generate(ask(chunks, n, max_tokens=20), time.perf_counter()) for n in (2, 3)]
    gate.set()
    for events, error in await asyncio.gather(*(ending(s) for s in streams)):  # one step: both fail
        assert isinstance(error, RuntimeError) and "the decode step broke" in str(error), error
    return "failed"


async def shut_down(loop, engine, chunks, monkeypatch):
    decoding = loop.generate(ask(chunks, max_tokens=3000), time.perf_counter())
    assert isinstance(await asyncio.wait_for(anext(decoding), 60), TokenEvent)
    held, release = threading.Event(), threading.Event()
    gate, blocker = await held_loop(loop)
    prefilling = loop.generate(ask(chunks), time.perf_counter())
    waiting = loop.generate(ask(chunks), time.perf_counter())  # max_prefill_tokens=1: admitted a step later
    assert loop.submit_background(lambda: (held.set(), release.wait(30)))
    gate.set()
    assert await asyncio.to_thread(held.wait, 30)  # `prefilling` ran a part; `waiting` waits
    assert (loop.scheduler.num_prefilling, loop.num_running, loop.num_waiting) == (1, 2, 1)
    closing = asyncio.create_task(asyncio.to_thread(loop.close, 30))
    while loop.submit_background(lambda: None):  # until `close` has begun
        await asyncio.sleep(0.01)
    release.set()
    assert await closing
    for events, error in await asyncio.gather(*(ending(s) for s in (decoding, prefilling, waiting))):
        assert isinstance(error, JobCancelled) and not any(isinstance(e, DoneEvent) for e in events)
    return "cancelled"


@pytest.mark.parametrize("way", [
    finished_at_its_first_token, finished_by_its_length, cancelled_while_waiting, cancelled_between_prefill_parts,
    cancelled_while_decoding, failed_in_its_first_prefill_part, failed_between_prefill_parts,
    failed_in_a_decode_step, shut_down,
], ids=lambda fn: fn.__name__)
def test_every_way_a_generation_leaves_the_loop_ends_its_stream(engine, chunks, monkeypatch, way):
    """Each stream ends (its DoneEvent, or the error it ended with), the scheduler holds nothing after,
    and the loop counts it once, as what it was; the loop then serves the next request."""
    monkeypatch.setattr(engine, "eos_ids", frozenset())  # answers run to their length unless a case says
    # a background unit every step (the cases hold the loop with one); one prefill admitted a step
    loop = generation_loop(engine, chunks, background_every_steps=1, max_prefill_tokens=1)
    try:
        kind = asyncio.run(way(loop, engine, chunks, monkeypatch))
        assert loop.num_waiting == loop.num_running == 0 and not loop.scheduler.is_busy
        stats = loop.stats
        jobs = stats.num_completed - (kind == "completed")  # the cases' own blocking jobs completed too
        counts = {"completed": stats.num_completed - jobs, "failed": stats.num_failed, "cancelled": stats.num_cancelled}
        expected = 3 if way is shut_down else 2 if way is failed_in_a_decode_step else 1
        assert counts == {k: expected if k == kind else 0 for k in counts}, counts
        if way is not shut_down:  # the loop goes on
            monkeypatch.undo()

            async def next_answer():
                return await ending(loop.generate(ask(chunks), time.perf_counter()))

            events, error = asyncio.run(next_answer())
            assert error is None and isinstance(events[-1], DoneEvent)
    finally:
        assert loop.close()
