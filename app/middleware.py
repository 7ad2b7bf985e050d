"""ASGI middleware: request body size limit (413) and per-route request metrics."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ErrorType, error_response
from app.metrics import Metrics


class BodyTooLarge(Exception):
    """Raised into the app when a body streams past the limit (the 413 is already sent)."""


class BodySizeLimitMiddleware:
    """Answers 413 when Content-Length, or the bytes actually received, exceed `max_bytes` (or the
    path's own limit in `path_limits`: file uploads are allowed more than JSON bodies)."""

    def __init__(self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None):
        self.app, self.max_bytes, self.path_limits = app, max_bytes, dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope["path"], self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._reject(scope, receive, send, max_bytes)
            return
        num_received, is_rejected, is_started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal num_received, is_rejected
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > max_bytes and not is_rejected:
                    is_rejected = True
                    if not is_started:
                        await self._reject(scope, receive, send, max_bytes)
                    raise BodyTooLarge(f"body over {max_bytes} bytes")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal is_started
            if is_rejected:
                return  # the 413 went out already
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except BodyTooLarge:
            pass

    async def _reject(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        response = error_response(
            413, ErrorType.PAYLOAD_TOO_LARGE, f"request body exceeds the limit of {max_bytes} bytes"
        )
        await response(scope, receive, send)


class MetricsMiddleware:
    """Counts requests and their latency by route template (not raw path, to bound label cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(method=scope["method"], route=path, status=str(status)).inc()
            self.metrics.latency.labels(route=path).observe(time.perf_counter() - start)
