"""Refuses browser requests a page from another site could make (drive-by writes, DNS rebinding).

Two checks, before any route runs (a 403 `permission_error` naming the header and the setting):
- Host: the request's `Host` name must be one the server answers to (`server.allowed_hosts`; by default
  the loopback names and `server.host`, or any name when it listens on a wildcard address, where the
  API key guards). A DNS-rebinding page reaches 127.0.0.1 under its own name, so its Host gives it away.
- Origin: a state-changing request (POST, PUT, PATCH, DELETE) that carries an `Origin` must come from
  the server's own origin (the Origin's host:port is the request's Host) or one in
  `server.allowed_origins`. A multipart upload is a "simple" request a foreign page may send without a
  CORS preflight; browsers always add its Origin. Without an Origin, `Sec-Fetch-Site: cross-site` or
  `same-site` refuses it too. Clients outside a browser (curl, `ragblend`) send neither and pass.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from app.errors import ErrorType, error_response
from app.config import ServerConfig

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY = "*"


def host_name(netloc: str) -> str:
    """'Example.org:8000' -> 'example.org', '[::1]:8000' -> '::1'."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].split("]", 1)[0]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host == ""


def allowed_host_names(server: ServerConfig) -> frozenset[str] | None:
    """The Host names accepted; None: any."""
    if server.allowed_hosts is None:
        if _is_wildcard(server.host):
            return None
        return LOOPBACK_NAMES | {host_name(server.host)}
    names = frozenset(host_name(h) for h in server.allowed_hosts)
    return None if ANY in names else names


class OriginGuardMiddleware:
    def __init__(self, app: ASGIApp, server: ServerConfig):
        self.app = app
        self.host_names = allowed_host_names(server)
        origins = {o.strip().rstrip("/").lower() for o in server.allowed_origins}
        self.is_any_origin, self.origins = ANY in origins, frozenset(origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await error_response(403, ErrorType.PERMISSION, refusal)(scope, receive, send)

    def refusal(self, scope: Scope) -> str | None:
        """Why the request is refused, or None."""
        headers = dict(scope.get("headers") or [])
        host = headers.get(b"host", b"").decode("latin-1")
        if self.host_names is not None and host_name(host) not in self.host_names:
            return (f"Host {host[:100]!r} is not a name this server answers to; add it to server.allowed_hosts "
                    "(RAGBLEND_SERVER__ALLOWED_HOSTS) if it is yours")
        if scope["method"] in SAFE_METHODS or self.is_any_origin:
            return None
        origin = headers.get(b"origin")
        if origin is None:
            site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
            if site in ("cross-site", "same-site"):
                return (f"a {site} browser request may not change anything here; add its origin to "
                        "server.allowed_origins if it is yours")
            return None
        text = origin.decode("latin-1").strip().rstrip("/").lower()
        if text in self.origins or (text != "null" and urlsplit(text).netloc == host.strip().lower()):
            return None
        return (f"a browser page from origin {text[:100]!r} may not change anything here; add it to "
                "server.allowed_origins (RAGBLEND_SERVER__ALLOWED_ORIGINS) if it is yours")
