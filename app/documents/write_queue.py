"""Writes (ingests, deletes) one at a time, on their own threads, off the engine loop.

A write's embedding, SQLite commit and index update never hold the engine; only its chunks' KV
precompute runs on the engine loop, one chunk per background unit (`EngineLoop.call_background`),
so a chat waits for at most one chunk's precompute, never for a whole upload."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable, TypeVar

import anyio

from runtime.jobs import JobCancelled, QueueFull

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
            return await asyncio.shield(asyncio.ensure_future(anyio.to_thread.run_sync(locked)))
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
        return True
