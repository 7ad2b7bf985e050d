"""/metrics stays bounded and never holds the event loop: requests with made-up methods and paths (any
client can send them, no key needed) add no series, every request label coming from a fixed set; and
the render runs in a worker thread, so /healthz answers while a scrape is in progress. The model is
left unloadable on purpose: nothing here needs it."""

from __future__ import annotations

import asyncio
import random
import re
import string
import threading

import httpx
import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from app.metrics import HTTP_METHODS, OTHER_LABEL, method_label
from app.testing import LiveServer
from configs.settings import load_settings

API_KEY = "metrics-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERIES = re.compile(r'^ragblend_requests_total\{method="([^"]*)",route="([^"]*)",status="([^"]*)"\}', re.M)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics")
    settings = load_settings(data_dir=tmp, model={"name": str(tmp / "missing.gguf")}, server={"api_key": API_KEY})
    with LiveServer(settings, is_waiting=False) as live:
        yield live


def request_series(http: httpx.Client) -> set[tuple[str, str, str]]:
    response = http.get("/metrics", headers=AUTH)
    assert response.status_code == 200, response.text
    return set(SERIES.findall(response.text))


def send_random_requests(http: httpx.Client, rng: random.Random, count: int) -> None:
    paths = ["/", "/healthz", "/v1/documents", "/v1/documents/{}", "/static/{}.js", "/{}", "/v1/{}/{}"]
    for _ in range(count):
        method = "".join(rng.choices(string.ascii_uppercase, k=rng.randint(3, 12)))  # h11 takes any token
        words = ["".join(rng.choices(string.ascii_lowercase + string.digits, k=8)) for _ in range(2)]
        http.request(method, rng.choice(paths).format(*words))


def test_made_up_methods_and_paths_add_no_series(server):
    rng = random.Random(20240611)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        # the app's route templates: the schema's and the few left out of it
        routes = set(http.get("/openapi.json", headers=AUTH).json()["paths"])
        routes |= {"/", "/static", "/docs", "/openapi.json", "/docs/assets/{name}", OTHER_LABEL}
        for method in ("GET", "DELETE"):  # the standard methods are their own label
            http.request(method, "/healthz")
            http.request(method, f"/v1/documents/{rng.randrange(10**9)}")
        send_random_requests(http, rng, 300)
        first = request_series(http)
        size_after_first = len(http.get("/metrics", headers=AUTH).content)
        send_random_requests(http, rng, 300)
        second = request_series(http)
        size_after_second = len(http.get("/metrics", headers=AUTH).content)
    assert {method for method, _, _ in second} <= HTTP_METHODS | {OTHER_LABEL}
    assert {route for _, route, _ in second} <= routes
    assert ("other", "other", "404") in second and ("other", "/v1/documents", "405") in second
    assert {("GET", "/healthz", "200"), ("DELETE", "/healthz", "405"),
            ("DELETE", "/v1/documents/{document_id}", "401")} <= second
    assert second - first <= {("GET", "/metrics", "200")}  # 300 more made-up requests: no new series
    assert size_after_second < size_after_first + 200  # only the counters' digits grew
    assert len(second) < 40


def test_method_labels():
    assert [method_label(m) for m in ("GET", "DELETE", "get", "BREW", "X" * 1000)] == [
        "GET", "DELETE", "other", "other", "other"]


class _BlockingCollector(Collector):
    """Holds the render until released, and records whether it ran on an event loop's thread."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.ran_on_event_loop: bool | None = None

    def collect(self):
        try:
            asyncio.get_running_loop()
            self.ran_on_event_loop = True
        except RuntimeError:
            self.ran_on_event_loop = False
        self.entered.set()
        self.release.wait(60)
        yield GaugeMetricFamily("ragblend_test_blocking", "held until released", value=1)


def test_the_render_runs_off_the_event_loop(server):
    collector = _BlockingCollector()
    registry = server.app.state.metrics.registry
    registry.register(collector)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            scrape = threading.Thread(target=lambda: http.get("/metrics", headers=AUTH), daemon=True)
            scrape.start()
            assert collector.entered.wait(30), "the render did not start"
            # the render is held: an event loop that ran it could not answer this at all
            assert http.get("/healthz", timeout=10).status_code == 200
            assert collector.ran_on_event_loop is False
            collector.release.set()
            scrape.join(30)
    finally:
        collector.release.set()
        registry.unregister(collector)
