"""Start-up: a server whose model cannot load stays alive, says why on /readyz, and answers 503."""

from __future__ import annotations

import time

import httpx

from app.testing import LiveServer
from configs.settings import load_settings


def test_a_failed_start_keeps_health_up_and_reports_not_ready(tmp_path):
    settings = load_settings(data_dir=tmp_path, model={"name": str(tmp_path / "missing.gguf")})
    with LiveServer(settings, is_waiting=False) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        deadline = time.monotonic() + 60
        while (ready := http.get("/readyz")).json()["status"] == "loading" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        assert "missing.gguf" in ready.json()["error"]
        response = http.post("/v1/query", json={"question": "anything"})
        assert response.status_code == 503 and response.json()["error"]["type"] == "not_ready"
        assert http.get("/v1/models").status_code == 503
