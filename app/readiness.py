"""Waiting for a server to come up: a free loopback port, and /readyz polled until it says ready.
No FastAPI or torch here, so a client (the server bench starting `ragblend serve`) can use it cheaply."""

from __future__ import annotations

import socket
import time
from typing import Callable

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, check_alive: Callable[[], None], timeout_s: float, poll_s: float) -> None:
    """Poll `url`/readyz until it answers 200; `check_alive()` raises when the server died meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        try:
            response = httpx.get(f"{url}/readyz", timeout=5)
            if response.status_code == 200:
                return
            if response.json().get("status") == "failed":
                raise RuntimeError(f"server failed to start: {response.json().get('error')}")
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"server not ready after {timeout_s} s")
