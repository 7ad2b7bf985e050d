"""The engine worker: one thread runs engine jobs one at a time, fed by a bounded queue.

The event loop only awaits futures and async queues, so it never blocks on the model. A job
checks its `cancelled` event between tokens, so a client that goes away frees the worker.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from app.errors import ApiError, ErrorType, QueueFullError

logger = logging.getLogger(__name__)

Emit = Callable[[Any], None]
_END = object()


class JobCancelled(ApiError):
    """Raised inside a job whose client went away, or when the server shuts down. An ApiError (503), so
    a request still waiting for it at shutdown answers plainly, without a traceback in the log."""

    status_code = 503
    error_type = ErrorType.NOT_READY


@dataclass
class Job:
    fn: Callable[["Job"], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: threading.Event = field(default_factory=threading.Event)

    def check(self) -> None:
        if self.cancelled.is_set():
            raise JobCancelled("cancelled: the client went away or the server is shutting down")


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
    """Requests' jobs first, in order; background tasks (e.g. KV repairs) only when none waits, so
    they never delay an answer by more than the one task already running, and never run beside
    the engine's own forward on another thread."""

    def __init__(self, max_queue: int, retry_after_s: int = 2, max_background: int = 64):
        self.max_queue, self.retry_after_s, self.max_background = max_queue, retry_after_s, max_background
        self.stats = WorkerStats()
        self._cond = threading.Condition()
        self._jobs: deque[Job] = deque()
        self._background: deque[Callable[[], None]] = deque()
        self._current: Job | None = None
        self._is_closing = False
        self._thread = threading.Thread(target=self._loop, name="engine-worker", daemon=True)
        self._thread.start()

    @property
    def num_waiting(self) -> int:
        return len(self._jobs)

    @property
    def is_busy(self) -> bool:
        return self._current is not None

    def submit(self, fn: Callable[[Job], Any]) -> Job:
        """Queue `fn(job)`; await `job.future` for its result. Raises QueueFullError when full."""
        loop = asyncio.get_running_loop()
        job = Job(fn, loop, loop.create_future())
        job.future.add_done_callback(_retrieve)  # a stream left early never awaits its job: no warning then
        with self._cond:
            if self._is_closing:
                raise QueueFullError("server is shutting down", self.retry_after_s)
            if len(self._jobs) >= self.max_queue:
                self.stats.num_rejected += 1
                raise QueueFullError(f"engine queue full ({self.max_queue} waiting)", self.retry_after_s)
            self._jobs.append(job)
            self._cond.notify()
        return job

    def submit_background(self, fn: Callable[[], None]) -> bool:
        """Queue a low-priority task (any thread); False when the background queue is full or closed."""
        with self._cond:
            if self._is_closing or len(self._background) >= self.max_background:
                return False
            self._background.append(fn)
            self._cond.notify()
        return True

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

        job = self.submit(body)
        # A job cancelled before it started never runs `body`, so only its settling can end the stream:
        # without this, a queued request whose client left awaited its items for ever, and uvicorn's
        # shutdown waited on that task ("Waiting for background tasks") before it stopped this worker.
        job.future.add_done_callback(lambda _: items.put_nowait(_END))
        return JobStream(job, items)

    def close(self, timeout_s: float = 60.0) -> bool:
        """Cancel the running and queued jobs (they stop at their next check: an ingest after the
        document it is writing), drop background tasks, and wait for the thread. Returns whether it
        stopped: only then may the stores it writes be closed."""
        with self._cond:
            self._is_closing = True
            self._background.clear()
            for job in [self._current, *self._jobs]:
                if job is not None:
                    job.cancelled.set()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error("engine worker still busy after %.0f s at shutdown", timeout_s)
        return not self._thread.is_alive()

    def _next(self) -> Job | Callable[[], None] | None:
        with self._cond:
            while True:
                if self._jobs:
                    self._current = self._jobs.popleft()
                    return self._current
                if self._is_closing:
                    return None
                if self._background:
                    return self._background.popleft()
                self._cond.wait()

    def _loop(self) -> None:
        while (task := self._next()) is not None:
            if isinstance(task, Job):
                self._run_job(task)
            else:
                self._run_background(task)

    def _run_background(self, task: Callable[[], None]) -> None:
        try:
            task()
        except Exception:  # a background task's failure is its own business (it counts it)
            logger.exception("background engine task failed")

    def _run_job(self, job: Job) -> None:
        try:
            if job.cancelled.is_set():
                self.stats.num_cancelled += 1
                job.loop.call_soon_threadsafe(_settle, job.future, None, JobCancelled("cancelled before start"))
                return
            try:
                result, error = job.fn(job), None
                self.stats.num_completed += 1
            except JobCancelled as exc:
                result, error = None, exc
                self.stats.num_cancelled += 1
            except Exception as exc:  # the job's own failure goes back to its request
                result, error = None, exc
                if isinstance(exc, ApiError) and exc.status_code < 500:
                    self.stats.num_completed += 1  # a 4xx (a DELETE of no such document) is an answer, not a failure
                else:
                    logger.exception("engine job failed")
                    self.stats.num_failed += 1
            job.loop.call_soon_threadsafe(_settle, job.future, result, error)
        finally:
            with self._cond:
                self._current = None


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
