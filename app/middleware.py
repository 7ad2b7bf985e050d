"""ASGI middleware: request body guard (size 413, UTF-8 400, read timeout 408) and per-route metrics."""

from __future__ import annotations

import asyncio
import codecs
import time

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.errors import ErrorType, error_response
from app.metrics import OTHER_LABEL, Metrics, method_label


class BodyRejected(Exception):
    """Raised into the app when a body turns out bad while it streams in (the error is already sent)."""


def _is_json(scope: Scope) -> bool:
    content_type = dict(scope.get("headers") or []).get(b"content-type", b"").split(b";")[0].strip().lower()
    return content_type == b"application/json" or content_type.endswith(b"+json")


def _too_large(max_bytes: int) -> str:
    return f"request body exceeds the limit of {max_bytes} bytes"


class BodyGuardMiddleware:
    """Guards request bodies as they stream in: 413 past `max_bytes` (declared or received), 400 for a
    JSON body that is not UTF-8 (a clear message instead of a parser's), and 408 when the body is not
    all in within `read_timeout_s` of the first read (a slowloris body holds no connection for long).
    `path_limits`: a path's own size limit (file uploads are allowed more than JSON bodies)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float, path_limits: dict[str, int] | None = None):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope["path"], self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            await self._reject(scope, receive, send, 413, ErrorType.PAYLOAD_TOO_LARGE, _too_large(max_bytes))
            return
        decoder = codecs.getincrementaldecoder("utf-8")() if _is_json(scope) else None
        num_received, deadline, is_body_done = 0, None, False
        is_rejected, is_started = False, False

        async def reject(status: int, error_type: ErrorType, message: str) -> None:
            nonlocal is_rejected
            is_rejected = True
            if not is_started:
                await self._reject(scope, receive, send, status, error_type, message)
            raise BodyRejected(message)

        async def guarded_receive() -> Message:
            nonlocal num_received, deadline, is_body_done
            if is_body_done:  # past the body only http.disconnect comes, whenever it does
                return await receive()
            deadline = deadline or time.monotonic() + self.read_timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                await reject(408, ErrorType.INVALID_REQUEST,
                             f"the request body was not received within {self.read_timeout_s:g} s")
            if message["type"] != "http.request":
                return message
            body, is_body_done = message.get("body", b""), not message.get("more_body", False)
            num_received += len(body)
            if num_received > max_bytes:
                await reject(413, ErrorType.PAYLOAD_TOO_LARGE, _too_large(max_bytes))
            if decoder is not None:
                try:
                    decoder.decode(body, final=is_body_done)
                except UnicodeDecodeError as exc:
                    await reject(400, ErrorType.INVALID_REQUEST, f"the JSON body is not valid UTF-8: byte "
                                 f"0x{exc.object[exc.start]:02x} at offset {num_received - len(body) + exc.start}")
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal is_started
            if is_rejected:
                return  # the error went out already
            is_started = is_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except BodyRejected:
            pass

    @staticmethod
    async def _reject(scope: Scope, receive: Receive, send: Send, status: int, error_type: ErrorType,
                      message: str) -> None:
        # the rest of the body is never read: the connection cannot carry another request
        await error_response(status, error_type, message, headers={"Connection": "close"})(scope, receive, send)


class MetricsMiddleware:
    """Counts requests and their latency by method and route. Every label comes from a fixed set, so no
    request line can add series: the standard methods (app.metrics.HTTP_METHODS), the matched route's
    template ('/v1/documents/{document_id}', never the raw path), `other` for anything else."""

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
            route = route_label(scope)
            self.metrics.requests.labels(method=method_label(scope["method"]), route=route, status=str(status)).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - start)


def route_label(scope: Scope) -> str:
    """The template of the route the router matched (one of the app's, set in the scope by routing),
    `other` where none matched (a 404, or a request refused before routing)."""
    route = scope.get("route")
    path = getattr(route, "path", None) if isinstance(route, BaseRoute) else None
    return path if isinstance(path, str) and path else OTHER_LABEL
