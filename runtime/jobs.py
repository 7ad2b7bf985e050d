"""Work handed to the engine loop from other threads, and what comes back: a `Job` is settled through
its asyncio future; a `JobStream` is what a generation (or a streaming job) emits, as an async iterator."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar, cast

T = TypeVar("T")
Emit = Callable[[Any], None]
END = object()  # the last item a stream emits


class JobCancelled(Exception):
    """Raised inside a job whose client went away (or at shutdown)."""


class QueueFull(Exception):
    """The engine's queue is full or closing: the caller should retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s


@dataclass
class Job:
    """A unit of work from an event loop: its result (or failure) settles `future` on that loop."""

    fn: Callable[["Job"], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def is_cancelled(self) -> bool:
        return self.cancelled.is_set()

    def cancel(self) -> None:
        """From any thread: the job stops at its next check (a generation: at the scheduler's next step)."""
        self.cancelled.set()

    def check(self) -> None:
        if self.cancelled.is_set():
            raise JobCancelled("client went away")

    def settle(self, result: Any, error: BaseException | None) -> None:
        """From any thread: hand the result (or the error) to the job's event loop."""
        try:
            self.loop.call_soon_threadsafe(_settle, self.future, result, error)
        except RuntimeError:  # the event loop is closed: nobody waits any more
            pass


class JobStream(Generic[T]):
    """What a streaming job emits (items of type T, then END), as an async iterator. `cancel()` stops
    the job at its next check (a generation: at the scheduler's next step)."""

    def __init__(self, job: Job, items: asyncio.Queue[T | object]):
        self._job, self._items = job, items

    @property
    def job(self) -> Job:
        return self._job

    def __aiter__(self) -> JobStream[T]:
        return self

    async def __anext__(self) -> T:
        item = await self._items.get()
        if item is END:
            await self._job.future  # re-raises the job's failure, if any
            raise StopAsyncIteration
        return cast(T, item)  # anything but END is a T

    def cancel(self) -> None:
        self._job.cancel()


def emitter(loop: asyncio.AbstractEventLoop, items: asyncio.Queue) -> Emit:
    """`emit(item)` from any thread puts `item` on the event loop's queue."""

    def emit(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody reads any more
            pass

    return emit


def new_job(fn: Callable[[Job], Any]) -> Job:
    """A job bound to the running event loop (a stream left early never awaits its future: no warning)."""
    loop = asyncio.get_running_loop()
    job = Job(fn, loop, loop.create_future())
    job.future.add_done_callback(_retrieve)
    return job


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
