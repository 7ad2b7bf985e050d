"""SIGTERM ends `ragblend serve` within a bound in every state: idle, streaming, queued, a queued
request whose client left (cancelled while queued), ingesting, and background KV work; and a second
server on the same data directory refuses to start with one line. Black-box (tests/shutdown_harness.py):
a real process, signals, timings, the log. Marked slow: one server start per state (~20 s each)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx
import pytest

from tests.shutdown_harness import ServeProcess, in_background

MODEL_FROM_YAML = True  # its servers' model is the YAML config's (tests/conftest.py)

pytestmark = pytest.mark.slow

BOUND_S = 60.0  # the hang this guards against lasted for ever; a clean shutdown here takes seconds
PAGE = " ".join(f"Sentence {i} tells of lighthouses, keepers, storms and the ships they saved." for i in range(220))

def ingest_body(num_documents: int) -> dict:
    return {"documents": [{"id": f"big{i}", "text": f"{i} {PAGE}"} for i in range(num_documents)]}


def ask_json(url: str) -> None:
    httpx.post(f"{url}/v1/query", json={"question": "Which lighthouse?", "max_tokens": 8}, timeout=300)


def ask_stream(url: str, seen_sources) -> None:
    with httpx.stream("POST", f"{url}/v1/query", json={"question": "Which lighthouse?", "stream": True,
                                                       "max_tokens": 1024}, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("event: sources"):
                seen_sources.set()


def ask_and_leave(port: int) -> None:
    """A non-streaming question whose client disconnects while its job waits in the queue."""
    body = b'{"question": "Which lighthouse?", "max_tokens": 8}'
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/query HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(1.0)  # queued behind the ingest; then the client goes away


def start_ingest(server: ServeProcess, num_documents: int = 12) -> None:
    """An ingest that runs for a while (each document: ~100 chunks embedded, and precomputed on the engine
    loop one chunk per background unit)."""
    body = ingest_body(num_documents)
    in_background(lambda: httpx.post(f"{server.url}/v1/documents", json=body, timeout=600))
    server.wait_for("the ingest running", lambda: server.metric("ragblend_writes_running") == 1)


def idle(server: ServeProcess) -> None:
    pass


def ingesting(server: ServeProcess) -> None:
    start_ingest(server)


def start_stream(server: ServeProcess) -> None:
    """A long streaming answer (1024 tokens) while an ingest runs: with `scheduler.max_running: 1` (the
    harness's config) a second question waits in the queue behind it."""
    import threading

    start_ingest(server)
    seen_sources = threading.Event()
    in_background(ask_stream, server.url, seen_sources)
    server.wait_for("the stream's first event", seen_sources.is_set)


def queued(server: ServeProcess) -> None:
    start_stream(server)
    in_background(ask_json, server.url)
    server.wait_for("the question queued", lambda: server.metric("ragblend_engine_waiting") >= 1)


def streaming(server: ServeProcess) -> None:
    start_stream(server)


def cancelled_while_queued(server: ServeProcess) -> None:
    """The reported hang: the client left while its request was queued; the engine loop then drops
    it. Once the queue has drained, nothing is in flight: shutdown must not wait on anything."""
    start_stream(server)
    ask_and_leave(server.port)
    server.wait_for("the queue drained (the stream done, the left question dropped)",
                    lambda: server.metric("ragblend_engine_busy") == 0
                    and server.metric("ragblend_engine_waiting") == 0, timeout_s=600)


def background_work(server: ServeProcess) -> None:
    """A document over retrieval.max_inline_kv_chars: committed at once, its KV computed in the
    background lane (one chunk per low-priority task), where SIGTERM finds the engine."""
    big = {"documents": [{"id": "backfilled", "text": " ".join([PAGE] * 3)}]}
    response = httpx.post(f"{server.url}/v1/documents", json=big, timeout=600)
    assert response.status_code == 201 and response.json()["documents"][0]["kv_pending"], response.text
    chunks = httpx.get(f"{server.url}/v1/documents/backfilled", timeout=60).json()["chunks"]
    assert not all(c["kv_cached"] for c in chunks)  # SIGTERM comes while the background lane has work


@pytest.mark.parametrize("state", [idle, streaming, queued, cancelled_while_queued, ingesting, background_work],
                         ids=lambda fn: fn.__name__)
def test_sigterm_ends_the_server_within_a_bound(tmp_path, state):
    server = ServeProcess(tmp_path / "data", tmp_path / "serve.log")
    try:
        server.start()
        state(server)
        seconds = server.terminate(BOUND_S)
    finally:
        server.kill()
    log = server.log()
    print(f"\n{state.__name__}: exited {seconds:.1f} s after SIGTERM")
    # uvicorn re-raises the SIGTERM it caught once its shutdown is done: the exit status says "terminated"
    assert server.process.returncode in (0, -signal.SIGTERM), log[-3000:]
    assert "Application shutdown complete" in log, log[-3000:]  # the lifespan's shutdown steps ran
    assert "timeout graceful shutdown exceeded" not in log, log[-3000:]  # nothing left waiting for ever
    assert "Traceback" not in log, log[-3000:]


def test_a_second_server_on_the_same_data_directory_refuses_in_one_line(tmp_path):
    first = ServeProcess(tmp_path / "data", tmp_path / "first.log")
    try:
        first.start()
        second = subprocess.run(first.argv(port=0), cwd=first.config_path.parent, env=first.env(),
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 4, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "is in use by another ragblend server" in lines[0], second.stderr
        assert str(first.process.pid) in lines[0] and str(tmp_path / "data") in lines[0]
        assert httpx.get(f"{first.url}/readyz", timeout=30).status_code == 200  # the first one is untouched
        first.terminate(BOUND_S)
    finally:
        first.kill()
    again = ServeProcess(tmp_path / "data", tmp_path / "again.log")  # the lock went with the first process
    try:
        again.start()
        again.terminate(BOUND_S)
    finally:
        again.kill()
