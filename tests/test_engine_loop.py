"""The engine loop's jobs: one exclusive job at a time, a bounded queue (503), cancellation between
steps, background units only when nothing waits, a clean close. (Generations in the batch:
tests/test_scheduler.py and tests/test_server_batching.py.)"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runtime.config import SchedulerConfig
from runtime.jobs import JobCancelled, QueueFull
from runtime.loop import EngineLoop


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
