"""A real redis-server on a loopback port, for the Redis tier tests (no persistence, no network)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """Start/stop/restart a redis-server process on 127.0.0.1:`port` (same port across restarts).
    `password`: requirepass, as docker-compose.yml runs it (the URL then carries it)."""

    def __init__(self, workdir: Path, password: str | None = None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (CI installs it from Debian: apt-get install redis-server)")
        self.port, self.workdir, self.password = free_port(), workdir, password
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--protected-mode", "yes"]
        if self.password:
            cmd += ["--requirepass", self.password]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self._proc.returncode}: {err[-500:]}")
            try:
                if client.ping():
                    client.close()
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def stop(self) -> None:
        stop_process(self._proc)
        self._proc = None


def stop_process(proc: subprocess.Popen | None) -> None:
    """Terminate a server the tests started (kill it after 10 s) and close its stderr pipe."""
    if proc is None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stderr:
        proc.stderr.close()


def start_or_skip(workdir: Path, password: str | None = None) -> RedisServer:
    """A started server, or the calling test skipped, saying why none could start on this machine."""
    import pytest  # only tests call this

    try:
        server = RedisServer(workdir, password)
        server.start()
    except (FileNotFoundError, RuntimeError) as exc:
        pytest.skip(f"no redis-server could start on loopback: {exc}")
    return server
