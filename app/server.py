"""What `ragblend serve` checks before it loads anything, and the uvicorn set-up shared with tests:
no public address without an API key (unless allowed), the port bound first (a taken port fails in
a second, not after the model has loaded), and the header deadline against slowloris."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import uvicorn

from app.http_protocol import header_deadline_protocol
from configs.settings import ServerSettings, Settings


class ServeError(Exception):
    """A reason not to start, for one line on stderr."""


class InsecureBindError(ServeError):
    pass


class PortUnavailableError(ServeError):
    pass


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and names that resolve only to them; '0.0.0.0', '::' and '' are public."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    if not host:
        return False
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_exposure(server: ServerSettings) -> None:
    """Refuse a non-loopback host without an API key, unless server.allow_public_without_key."""
    if server.api_key or server.allow_public_without_key or is_loopback(server.host):
        return
    raise InsecureBindError(
        f"refusing to listen on {server.host} without an API key: anyone who can reach it could use and "
        "change the server. Set server.api_key (RAGBLEND_SERVER__API_KEY), listen on 127.0.0.1, or pass "
        "--allow-insecure-public (server.allow_public_without_key) if a proxy in front guards it"
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a taken port is an error before anything loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise PortUnavailableError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def uvicorn_config(app: Any, settings: Settings, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        http=header_deadline_protocol(settings.server.header_timeout_s),
    )
