"""The engine worker: one thread runs engine jobs one at a time, fed by a bounded queue.

The event loop only awaits futures and async queues, so it never blocks on the model. A job
checks its `cancelled` event between tokens, so a client that goes away frees the worker.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from app.errors import QueueFullError

logger = logging.getLogger(__name__)

Emit = Callable[[Any], None]
_END = object()


class JobCancelled(Exception):
    """Raised inside a job whose client went away."""


@dataclass
class Job:
    fn: Callable[["Job"], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if self.cancelled.is_set():
            raise JobCancelled("client went away")


class JobStream:
    """What a streaming job emits, as an async iterator. `cancel()` stops the job at its next check."""

    def __init__(self, job: Job, items: asyncio.Queue):
        self._job, self._items = job, items

    @property
    def job(self) -> Job:
        return self._job

    def __aiter__(self) -> JobStream:
        return self

    async def __anext__(self) -> Any:
        item = await self._items.get()
        if item is _END:
            await self._job.future  # re-raises the job's failure, if any
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self._job.cancelled.set()


@dataclass
class WorkerStats:
    num_completed: int = 0
    num_failed: int = 0
    num_cancelled: int = 0
    num_rejected: int = 0


class EngineWorker:
    def __init__(self, max_queue: int, retry_after_s: int = 2):
        self.max_queue, self.retry_after_s = max_queue, retry_after_s
        self.stats = WorkerStats()
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._num_waiting = 0
        self._is_busy = False
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def is_busy(self) -> bool:
        return self._is_busy

    def submit(self, fn: Callable[[Job], Any]) -> Job:
        """Queue `fn(job)`; await `job.future` for its result. Raises QueueFullError when full."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._num_waiting >= self.max_queue:
                self.stats.num_rejected += 1
                raise QueueFullError(f"engine queue full ({self.max_queue} waiting)", self.retry_after_s)
            self._num_waiting += 1
        job = Job(fn, loop, loop.create_future())
        job.future.add_done_callback(_retrieve)  # a stream left early never awaits its job: no warning then
        self._jobs.put(job)
        return job

    async def run(self, fn: Callable[[Job], Any]) -> Any:
        job = self.submit(fn)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.cancelled.set()
            raise

    def stream(self, fn: Callable[[Job, Emit], Any]) -> JobStream:
        """Queue `fn(job, emit)` now (QueueFullError if full); iterate the result for what it emits."""
        items: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def emit(item: Any) -> None:
            loop.call_soon_threadsafe(items.put_nowait, item)

        def body(job: Job) -> Any:
            try:
                return fn(job, emit)
            finally:
                emit(_END)

        return JobStream(self.submit(body), items)

    def close(self, timeout_s: float = 10.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._num_waiting -= 1
            if job.cancelled.is_set():
                self.stats.num_cancelled += 1
                job.loop.call_soon_threadsafe(_settle, job.future, None, JobCancelled("cancelled before start"))
                continue
            self._is_busy = True
            try:
                result, error = job.fn(job), None
                self.stats.num_completed += 1
            except JobCancelled as exc:
                result, error = None, exc
                self.stats.num_cancelled += 1
            except Exception as exc:  # the job's own failure goes back to its request
                logger.exception("engine job failed")
                result, error = None, exc
                self.stats.num_failed += 1
            finally:
                self._is_busy = False
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
