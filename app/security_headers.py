"""Browser hardening headers on every response (the chat page's own policy is set by app.web).

- `X-Content-Type-Options: nosniff`: a browser takes a response for what its Content-Type says (an
  uploaded text never runs as a script or renders as HTML by sniffing).
- `X-Frame-Options: DENY` and CSP `frame-ancestors 'none'`: no page of another site can frame the chat
  page (or anything else here) to trick clicks on it.
- `Referrer-Policy: same-origin`: URLs of this server are not sent to other sites. Not `no-referrer`:
  under it the Fetch standard has the page's own POSTs carry `Origin: null`, which the origin guard
  refuses.
"""

from __future__ import annotations

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

FRAME_ANCESTORS = "frame-ancestors 'none'"
# The chat page (app/web/static): its own scripts and styles only, no inline code, no other origin.
CHAT_PAGE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
                 f"form-action 'self'; base-uri 'none'; {FRAME_ANCESTORS}")
SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": FRAME_ANCESTORS,  # the default: a route may set a fuller policy of its own
}


class SecurityHeadersMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    headers.setdefault(name, value)
            await send(message)

        await self.app(scope, receive, send_with_headers)
