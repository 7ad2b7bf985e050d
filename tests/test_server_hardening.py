"""The HTTP surface without a model: docs behind the key and CDN-free, header and body deadlines
(slowloris), bad UTF-8, no public listening without a key, a taken port fails fast, and stream
errors that leak nothing internal. The model is left unloadable on purpose: nothing here needs it."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from app.errors import InvalidRequestError, stream_error_body
from app.query.serving import QueryService
from app.rag.types import RagContext
from app.server import InsecureBindError, check_exposure, is_loopback
from app.testing import LiveServer, free_port
from app.config import ServerConfig
from configs.settings import load_settings

API_KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    settings = load_settings(data_dir=tmp, model={"name": str(tmp / "missing.gguf")},
                             server={"api_key": API_KEY, "header_timeout_s": TIMEOUT_S, "body_timeout_s": TIMEOUT_S})
    with LiveServer(settings, is_waiting=False) as live:
        yield live


def raw_connection(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds that took."""
    start, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return data, time.monotonic() - start


def test_docs_and_schema_need_the_key_and_load_nothing_from_a_cdn(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path in ("/docs", "/openapi.json", "/docs/assets/swagger-ui.css"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers=AUTH).status_code == 200, path
        page = http.get("/docs", headers=AUTH).text
        assert "/docs/assets/swagger-ui-bundle.js" in page and "/openapi.json" in page
        assert "http://" not in page and "https://" not in page  # every asset is served from here
        script = http.get("/docs/assets/swagger-ui-bundle.js", headers=AUTH)
        assert script.status_code == 200 and len(script.content) > 100_000
        assert http.get("/docs/assets/index.html", headers=AUTH).status_code == 404
        assert http.get("/redoc", headers=AUTH).status_code == 404
        assert "/v1/query" in http.get("/openapi.json", headers=AUTH).json()["paths"]


def test_half_sent_headers_are_cut_off_at_the_deadline(server):
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl")
        data, elapsed = read_until_closed(sock)
    assert data == b"" and TIMEOUT_S * 0.8 < elapsed < TIMEOUT_S + 3


def test_a_silent_connection_is_cut_off_at_the_deadline(server):
    with raw_connection(server) as sock:
        data, elapsed = read_until_closed(sock)
    assert data == b"" and elapsed < TIMEOUT_S + 3


def test_a_half_sent_body_is_a_408_at_the_deadline(server):
    with raw_connection(server) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100\r\n\r\n{\"question\"")
        data, elapsed = read_until_closed(sock)
    assert data.startswith(b"HTTP/1.1 408") and b"not received within 1 s" in data
    assert elapsed < TIMEOUT_S + 3


def test_a_kept_alive_connection_still_serves_after_an_idle_pause(server):
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with raw_connection(server) as sock:
        for _ in range(2):
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(TIMEOUT_S * 1.5)  # idle between requests is keep-alive's business, not the deadline's


def test_a_body_that_is_not_utf8_gets_a_clear_400(server):
    response = httpx.post(f"{server.url}/v1/query", content=b'{"question": "caf\xe9"}', timeout=30,
                          headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400 and "not valid UTF-8" in response.json()["error"]["message"]
    assert "offset 17" in response.json()["error"]["message"]


@pytest.mark.parametrize(("host", "is_local"), [("127.0.0.1", True), ("::1", True), ("localhost", True),
                                                ("0.0.0.0", False), ("::", False), ("10.1.2.3", False)])
def test_loopback_hosts(host, is_local):
    assert is_loopback(host) is is_local


def test_a_public_host_needs_a_key_or_an_explicit_allowance():
    with pytest.raises(InsecureBindError, match="without an API key"):
        check_exposure(ServerConfig(host="0.0.0.0"))
    check_exposure(ServerConfig(host="0.0.0.0", api_key="k"))
    check_exposure(ServerConfig(host="0.0.0.0", allow_public_without_key=True))
    check_exposure(ServerConfig(host="127.0.0.1"))


def run_serve(*args: str, tmp_path) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "RAGBLEND_SERVER__API_KEY": ""}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "app.cli", "serve", "--data-dir", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120, env=env)
    return done, time.monotonic() - start


def test_serve_refuses_a_taken_port_and_a_public_host_before_loading_anything(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        done, elapsed = run_serve("--port", str(taken.getsockname()[1]), tmp_path=tmp_path)
    assert done.returncode == 4 and "cannot listen on 127.0.0.1" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and elapsed < 60
    done, _ = run_serve("--host", "0.0.0.0", "--port", str(free_port()), tmp_path=tmp_path)
    assert done.returncode == 4 and "without an API key" in done.stderr, done.stderr


class _FailingStream:
    def __aiter__(self):
        return self

    async def __anext__(self):
        raise RuntimeError("secret internal detail: /var/lib/ragblend/kv/abc.kv")

    def cancel(self) -> None:
        pass


async def _events(stream) -> list[str]:
    service = QueryService(settings=None, pipeline=None, scopes=None)
    return [event async for event in service.events(RagContext([], [], 0.0), stream)]


def test_stream_errors_send_an_id_not_the_internal_message(caplog):
    import asyncio

    with caplog.at_level(logging.ERROR, logger="app.errors"):
        events = asyncio.run(_events(_FailingStream()))
    error = events[-1]
    assert error.startswith("event: error") and "secret" not in error and "error id" in error
    assert "RuntimeError" not in error  # no internal class names either
    error_id = error.split("error id ")[1].split(";")[0]
    assert any(error_id in r.getMessage() and "secret internal detail" in str(r.exc_info[1]) for r in caplog.records)
    # an ApiError's message is meant for the client and is kept
    assert stream_error_body(InvalidRequestError("too long"))["error"]["message"] == "too long"


def test_docker_compose_publishes_on_loopback_and_requires_a_key():
    import yaml
    from pathlib import Path

    compose = yaml.safe_load((Path(__file__).parents[1] / "docker-compose.yml").read_text())
    services = compose["services"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"nginx"}  # the replicas are reached through it only
    assert all(port.startswith("${RAGBLEND_PUBLISH_HOST:-127.0.0.1}:") for port in services["nginx"]["ports"])
    for name in ("ragblend-a", "ragblend-b"):  # compose stops when the key is unset
        assert ":?" in services[name]["environment"]["RAGBLEND_SERVER__API_KEY"]
