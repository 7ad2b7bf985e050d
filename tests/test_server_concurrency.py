"""Concurrency over real HTTP: 8 parallel streaming clients all finish; a client that disconnects
mid-stream cancels its generation and frees the worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.commands.ask import iter_events
from app.testing import LiveServer
from configs.settings import load_settings

pytestmark = pytest.mark.smollm2

QUESTION = "What is the secret code of the blue vault?"
DOCUMENTS = [
    {"id": "vault", "text": "The secret code of the blue vault is 4812."},
    {"id": "bridge", "text": "The red bridge in Lisbon was painted in 1966 by a team of forty workers."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with LiveServer(load_settings(data_dir=tmp_path_factory.mktemp("concurrency"))) as live:
        with httpx.Client(base_url=live.url, timeout=120) as http:
            assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
        yield live


def engine_jobs(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line.startswith("ragblend_engine_jobs_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            out[outcome] = float(line.split()[-1])
        elif line.startswith("ragblend_engine_busy "):
            out["busy"] = float(line.split()[-1])
    return out


async def stream_answer(client: httpx.AsyncClient, index: int) -> tuple[str, dict]:
    body = {"question": QUESTION, "max_tokens": 32, "top_k": 2, "mode": "blend" if index % 2 else "full"}
    async with client.stream("POST", "/v1/query", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line async for line in response.aiter_lines()]
    events = list(iter_events(lines))
    assert events[0][0] == "sources" and events[-1][0] == "done", events[-3:]
    return "".join(data["text"] for kind, data in events if kind == "token"), events[-1][1]


def test_eight_parallel_streaming_clients_all_get_complete_answers(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            return await asyncio.gather(*(stream_answer(client, i) for i in range(8)))

    results = asyncio.run(main())
    assert len(results) == 8
    for answer, done in results:
        assert "4812" in answer and done["finish_reason"] in {"stop", "length"}
        assert 0 < done["usage"]["completion_tokens"] <= 16


# ignore_eos: a generation that outlasts the clients' patience whatever the sampled text (a story's first blank line
# or end of turn would otherwise end it early, as a change of the prefill's arithmetic once did)
LONG_STORY = {"question": "Write a very long story about the blue vault and its secret code.", "max_tokens": 1000,
              "temperature": 1.0, "seed": 1, "ignore_eos": True}


def wait_for_cancel(url: str, before: dict[str, float]) -> dict[str, float]:
    started = time.monotonic()
    while time.monotonic() - started < 20:
        after = engine_jobs(url)
        if after.get("cancelled", 0) > before.get("cancelled", 0) and after["busy"] == 0:
            break
        time.sleep(0.1)
    return after


def test_a_client_that_disconnects_mid_stream_frees_the_worker(server):
    before = engine_jobs(server.url)
    body = {**LONG_STORY, "stream": True}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v1/query", json=body) as response:
            lines = response.iter_lines()
            kinds = []
            for kind, _ in iter_events(lines):
                kinds.append(kind)
                if kinds.count("token") == 3:
                    break  # leave after three tokens: the connection closes here
    after = wait_for_cancel(server.url, before)
    assert after["cancelled"] == before.get("cancelled", 0) + 1 and after["busy"] == 0
    quick = httpx.post(f"{server.url}/v1/query", json={"question": QUESTION, "max_tokens": 8}, timeout=120)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("path", ["/v1/query", "/v1/chat/completions"])
def test_a_non_streaming_client_that_gives_up_cancels_its_generation(server, path):
    before = engine_jobs(server.url)
    body = LONG_STORY if path == "/v1/query" else {  # the same request as a chat message
        "messages": [{"role": "user", "content": LONG_STORY["question"]}],
        **{k: v for k, v in LONG_STORY.items() if k != "question"}}
    with pytest.raises(httpx.ReadTimeout):  # the client hangs up after 1.5 s, mid-generation
        httpx.post(f"{server.url}{path}", json=body, timeout=httpx.Timeout(120, read=1.5))
    after = wait_for_cancel(server.url, before)
    assert after["cancelled"] == before.get("cancelled", 0) + 1 and after["busy"] == 0
