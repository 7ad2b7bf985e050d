"""The engine worker: one job at a time, a bounded queue (503), cancellation between steps."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from app.errors import QueueFullError
from app.worker import EngineWorker, JobCancelled


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
            assert set(names) == {"engine-worker"} and peak[0] == 1

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
            with pytest.raises(QueueFullError) as error:
                worker.submit(lambda job: "third")
            assert error.value.headers() == {"Retry-After": "7"} and error.value.status_code == 503
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
