"""What `ragblend serve` checks before it loads anything, and the uvicorn set-up shared with tests:
no public address without an API key (unless allowed), the port bound first (a taken port fails in
a second, not after the model has loaded), and the header deadline against slowloris."""

from __future__ import annotations

import asyncio
import fcntl
import ipaddress
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn

from app.http_protocol import header_deadline_protocol
from app.config import ServerConfig
from configs.settings import Settings


class ServeError(Exception):
    """A reason not to start, for one line on stderr."""


class InsecureBindError(ServeError):
    pass


class PortUnavailableError(ServeError):
    pass


class DataDirInUseError(ServeError):
    pass


LOCK_NAME = "ragblend.lock"


def lock_data_dir(data_dir: Path) -> int:
    """An exclusive lock on `data_dir` for this process's life (the returned fd holds it; the kernel
    drops it when the process ends, however it ends). A second server on the same directory would
    write the same SQLite file, index and KV files: it refuses to start instead."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise DataDirInUseError(f"the data directory {data_dir} is in use by another ragblend server (pid "
                                f"{holder}); stop it, or give this one another --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


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


def check_exposure(server: ServerConfig) -> None:
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


class Server(uvicorn.Server):
    """uvicorn's server, stopping the engine loop as soon as shutdown begins: running answers leave the
    batch at the next step, an ingest stops after its current document (its precompute is cancelled),
    and queued work ends at once, so the requests waiting on them answer and their connections close,
    instead of uvicorn waiting on them (up to server.shutdown_timeout_s) with the engine still working."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        components = getattr(getattr(self.config.app, "state", None), "components", None)
        if components is not None:
            await asyncio.to_thread(components.loop.close)
        await super().shutdown(sockets)


def uvicorn_config(app: Any, settings: Settings, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level=log_level, lifespan="on",
        http=header_deadline_protocol(settings.server.header_timeout_s),
        # without it uvicorn waits for every open connection (a queued answer, a stream) before the
        # lifespan's shutdown may stop the engine loop: shutdown would take as long as the queue's work
        timeout_graceful_shutdown=settings.server.shutdown_timeout_s,
    )
