"""Collect a non-streamed answer, cancelling the generation if the client goes away meanwhile."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

from app.errors import ClientClosedError
from app.rag.types import AnswerStream, DoneEvent, TokenEvent
from runtime.jobs import JobCancelled

IsDisconnected = Callable[[], Awaitable[bool]]
POLL_S = 0.25


async def collect(stream: AnswerStream, is_disconnected: IsDisconnected) -> tuple[str, DoneEvent]:
    watcher = asyncio.create_task(_cancel_on_disconnect(stream, is_disconnected))
    pieces: list[str] = []
    done: DoneEvent | None = None
    try:
        async for event in stream:
            if isinstance(event, TokenEvent):
                pieces.append(event.text)
            else:
                done = event
    except JobCancelled as exc:
        raise ClientClosedError("the client closed the connection; generation cancelled") from exc
    finally:
        watcher.cancel()
        stream.cancel()
    if done is None:
        raise RuntimeError("generation ended without a result")
    return "".join(pieces), done


async def _cancel_on_disconnect(stream: AnswerStream, is_disconnected: IsDisconnected) -> None:
    while not await is_disconnected():
        await asyncio.sleep(POLL_S)
    stream.cancel()
