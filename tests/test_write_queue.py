"""The writes' queue (ingests, deletes): one at a time, on one thread at the lowest CPU priority (so an
upload's extraction and embedding yield the cores to answers), refused with Retry-After once closing."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from app.documents.write_queue import WRITES_NICE, WriteQueue
from runtime.jobs import JobCancelled, QueueFull


def test_writes_run_one_at_a_time_on_a_thread_at_the_lowest_priority():
    queue = WriteQueue(max_waiting=8, retry_after_s=2)
    seen, active, lock = [], [0], threading.Lock()

    def write(check, i):
        with lock:
            active[0] += 1
            assert active[0] == 1  # one at a time
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) if sys.platform == "linux" else None
        seen.append((i, threading.current_thread() is not threading.main_thread(), niceness))
        with lock:
            active[0] -= 1
        return i

    async def main():
        return await asyncio.gather(*(queue.run(lambda check, i=i: write(check, i)) for i in range(4)))

    assert asyncio.run(main()) == [0, 1, 2, 3]
    assert all(off_main for _, off_main, _ in seen)
    if sys.platform == "linux":
        assert {niceness for _, _, niceness in seen} == {WRITES_NICE}
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) != WRITES_NICE  # only that thread's
    assert queue.close(timeout_s=5)


def test_a_closing_queue_refuses_writes_and_stops_the_queued_ones():
    queue = WriteQueue(max_waiting=8, retry_after_s=3)
    assert queue.close(timeout_s=5)

    async def main():
        await queue.run(lambda check: None)

    with pytest.raises(QueueFull) as refused:
        asyncio.run(main())
    assert refused.value.retry_after_s == 3
    assert queue.num_waiting == 0


def test_a_write_whose_client_left_stops_at_its_next_check():
    queue = WriteQueue(max_waiting=8, retry_after_s=2)
    started, release, outcome = threading.Event(), threading.Event(), []

    def write(check):
        started.set()
        release.wait(5)
        try:
            check()  # the client left meanwhile
        except JobCancelled as exc:
            outcome.append(exc)
            raise
        outcome.append("written")

    async def main():
        task = asyncio.ensure_future(queue.run(write))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        # the write goes on only once the cancellation is through (`run` re-raises at once, the write left
        # running): releasing it right after cancel() let a loaded machine's write check before the loop
        # had marked it cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()

    asyncio.run(main())
    assert queue.close(timeout_s=5)  # waits for the write in progress
    assert len(outcome) == 1 and isinstance(outcome[0], JobCancelled)
