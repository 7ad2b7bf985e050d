"""uvicorn's h11 protocol with a request-header deadline (against slowloris).

uvicorn's own timeouts cover idle keep-alive connections only: a client that sends half a request
line or half its headers holds the connection for ever. Here a connection whose request headers are
not complete within `header_timeout_s` (from its first byte, or from accepting it) is closed. The
body's deadline is app.middleware.BodyGuardMiddleware's: headers done, the ASGI app is in charge.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol

from app.config import ServerConfig


class HeaderDeadlineH11Protocol(H11Protocol):
    header_timeout_s: float = ServerConfig.header_timeout_s  # the configured one: `header_deadline_protocol`
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self._is_awaiting_headers():
            self._arm_header_timer()  # the next request on a kept-alive connection starts its clock
        super().data_received(data)
        if not self._is_awaiting_headers():
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _is_awaiting_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self._is_awaiting_headers() and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took over %g s", self.header_timeout_s)
            self.transport.close()


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineH11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with this server's header deadline."""
    return type("HeaderDeadlineH11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout_s": header_timeout_s})
