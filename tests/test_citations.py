"""Truth in answers, on a live server with a tiny random model: a PDF chunk spanning two pages (`tokens`
chunking; `structure` never spans pages: tests/test_retrieval_api.py) cites both (metadata, /v1/query and
/v1/chat/completions sources, `ragblend ask`), and /readyz says ready only once the loading planner's
start-up measurement has run (so the first question waits for nothing)."""

from __future__ import annotations

import httpx
import pytest

from app.cli import main
from app.testing import LiveServer
from configs.settings import load_settings
from tests.docgen import make_pdf

PAGE_ONE = [f"Page one line {i} tells of the harbour." for i in range(6)]
PAGE_TWO = [f"Page two line {i} tells of the lighthouse." for i in range(6)]
PAGE_THREE = ["Page three stands alone."]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("citations"),
                             model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"chunking": "tokens", "chunk_tokens": 400, "chunk_overlap": 0},
                             generation={"max_tokens": 2})  # tokens: one chunk packs every page
    with LiveServer(settings) as live:
        # ready means the engine is free: the start-up measurement ran before, not after, /readyz said so
        assert live.components.kv_store.planner.is_ready
        assert not live.components.loop.is_busy and live.components.loop.num_waiting == 0
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        pdf = make_pdf([PAGE_ONE, PAGE_TWO, PAGE_THREE])
        assert client.post("/v1/documents/files", files=[("files", ("harbour.pdf", pdf))]).status_code == 201
        yield client


def test_a_chunk_spanning_pages_records_its_page_range(http):
    detail = http.get("/v1/documents/harbour.pdf").json()
    assert detail["metadata"]["chunk_pages"][0] == 1
    assert detail["metadata"]["chunk_last_pages"][0] == 3  # one chunk over all three pages


def test_query_and_chat_sources_carry_the_pages(http):
    query = http.post("/v1/query", json={"question": "harbour?", "chunk_ids": ["harbour.pdf#0"]}).json()
    assert query["sources"][0]["pages"] == [1, 3]
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "harbour?"}],
                                                   "chunk_ids": ["harbour.pdf#0"]}).json()
    assert chat["sources"][0]["pages"] == [1, 3]
    with http.stream("POST", "/v1/query", json={"question": "harbour?", "chunk_ids": ["harbour.pdf#0"],
                                                "stream": True}) as streamed:
        first = next(line for line in streamed.iter_lines() if line.startswith("data:"))
    assert '"pages":[1,3]' in first.replace(" ", "")
    assert http.post("/v1/documents", json={"documents": [{"id": "plain", "text": "No pages here."}]}).status_code == 201
    plain = http.post("/v1/query", json={"question": "x", "chunk_ids": ["plain#0"]}).json()
    assert plain["sources"][0]["pages"] is None


def test_ragblend_ask_prints_the_pages(server, http, capsys):
    assert main(["ask", "harbour?", "--url", server.url, "--chunk-id", "harbour.pdf#0"]) == 0
    out = capsys.readouterr().out
    assert "harbour.pdf#0" in out and "pp. 1-3" in out, out
