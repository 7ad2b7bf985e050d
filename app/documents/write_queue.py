"""Writes (ingests, deletes) one at a time, on their own thread, off the engine loop.

A write's embedding, SQLite commit and index update never hold the engine; only its
chunks' KV precompute runs on the engine loop, one chunk per background unit (`EngineLoop.call_background`),
so a chat waits for at most one chunk's precompute, never for a whole upload. The writes' thread runs
at the lowest CPU priority (nice 19, Linux): on a CPU server its embedding would otherwise take cores
from the engine's answers (4 uploads during 8 chats: +1.4 s at the chats' median TTFT, measured in
docs/benchmarks/server.md), and it still gets every core the answers leave idle."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from runtime.jobs import JobCancelled, QueueFull

logger = logging.getLogger(__name__)
WRITES_NICE = 19  # the writes' thread: below everything else in this process

T = TypeVar("T")
Check = Callable[[], None]  # raises JobCancelled once the client left or the server is closing


class WriteQueue:
    def __init__(self, max_waiting: int, retry_after_s: int):
        self.max_waiting, self.retry_after_s = max_waiting, retry_after_s
        self._lock = threading.Lock()  # held by the write in progress
        self._count_lock = threading.Lock()
        self._num_waiting = 0
        self._is_writing = False
        self._closing = threading.Event()
        # one thread: writes run one at a time anyway, and its priority is its own (Linux: per thread)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writes", initializer=_lower_priority)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def is_writing(self) -> bool:
        return self._is_writing

    async def run(self, fn: Callable[[Check], T]) -> T:
        """Run `fn(check)` on a thread once the writes before it are done (QueueFull when too many
        wait). A client that goes away cancels it at its next `check()`."""
        with self._count_lock:
            if self._closing.is_set():
                raise QueueFull("server is shutting down", self.retry_after_s)
            if self._num_waiting >= self.max_waiting:
                raise QueueFull(f"write queue full ({self.max_waiting} waiting)", self.retry_after_s)
            self._num_waiting += 1
        cancelled = threading.Event()

        def check() -> None:
            if cancelled.is_set() or self._closing.is_set():
                raise JobCancelled("client went away" if cancelled.is_set() else "the server is shutting down")

        def locked() -> T:
            with self._lock:
                with self._count_lock:
                    self._num_waiting -= 1
                self._is_writing = True
                try:
                    check()
                    return fn(check)
                finally:
                    self._is_writing = False

        try:
            future = self._executor.submit(locked)
        except RuntimeError:  # closed between the check above and now
            with self._count_lock:
                self._num_waiting -= 1
            raise QueueFull("server is shutting down", self.retry_after_s) from None
        try:
            return await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def close(self, timeout_s: float) -> bool:
        """Stop taking writes and wait for the one in progress (it stops at its next check). Returns
        whether none runs any more: only then may the stores be closed."""
        self._closing.set()
        if not self._lock.acquire(timeout=timeout_s):
            return False
        self._lock.release()
        self._executor.shutdown(wait=False)  # writes still queued find the queue closing at their check
        return True


def _lower_priority() -> None:
    """The calling thread at WRITES_NICE, where the OS allows it (raising one's niceness always is)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITES_NICE)
    except OSError as exc:  # not Linux (a thread id is not a process id there): same priority as the rest
        logger.info("writes run at the server's CPU priority: %s", exc)
