"""The prefix cache through a live server (a tiny random model over loopback HTTP): the same question
twice answers the same tokens, the second from the kept prompt (its usage says so); a chat's follow-up
over the same passages reuses the turn before it; a request can opt out; a replaced or deleted document
drops the prompts holding its chunks; the metrics count it all. (`ragblend bench prefix`, which measured it
side by side, was retired in issue 64: docs/benchmarks/README.md#retired.)"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings

DOCUMENTS = [
    {"id": "vault", "text": "The secret code of the blue vault is 4812. The vault stands in the harbour of Porto."},
    {"id": "bridge", "text": "The red bridge in Lisbon was painted in 1966 by a team of forty workers."},
    {"id": "owls", "text": "Snowy owls hunt lemmings on the tundra and nest on the ground in spring."},
]
QUESTION = "What is the secret code of the blue vault?"
CHUNKS = ["vault#0", "bridge#0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("prefix"), model={"name": "random:tiny-llama", "device": "cpu"},
                             store={"prefix_cache_bytes": 256 << 20})
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
        yield live


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def query(http, **extra) -> dict:
    body = {"question": QUESTION, "chunk_ids": CHUNKS, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    response = http.post("/v1/query", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def chat(http, messages, **extra) -> dict:
    body = {"messages": messages, "chunk_ids": CHUNKS, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, **extra}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def metric(http, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_the_same_question_again_answers_the_same_tokens_from_the_kept_prompt(server, http):
    hits = metric(http, 'ragblend_prefix_cache_lookups_total{result="hit"}')
    first = query(http, mode="blend")
    second = query(http, mode="blend")
    assert first["usage"]["prefix_cached_tokens"] == 0 and first["usage"]["reused_tokens"] > 0
    usage = second["usage"]
    assert usage["prefix_cached_tokens"] == usage["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert (usage["reused_tokens"], usage["recomputed_tokens"]) == (0, 0)
    assert second["answer"] == first["answer"] and second["mode"] == "blend" and usage["completion_tokens"] == 8
    # streamed: the done event carries the same usage
    with http.stream("POST", "/v1/query", json={"question": QUESTION, "chunk_ids": CHUNKS, "max_tokens": 8,
                                                "temperature": 0.0, "ignore_eos": True, "mode": "blend",
                                                "stream": True}) as response:
        lines = list(response.iter_lines())
    done = json.loads(lines[lines.index("event: done") + 1].removeprefix("data: "))
    assert done["usage"]["prefix_cached_tokens"] == usage["prompt_tokens"]
    assert metric(http, 'ragblend_prefix_cache_lookups_total{result="hit"}') == hits + 2
    assert metric(http, 'ragblend_prompt_tokens_total{kind="prefix_cached"}') >= 2 * usage["prompt_tokens"]
    assert 0 < metric(http, "ragblend_prefix_cache_bytes") <= metric(http, "ragblend_prefix_cache_max_bytes") == 256 << 20
    # another mode asked: not served from the blend's prompt; opted out: neither read nor kept
    assert query(http, mode="full")["usage"]["prefix_cached_tokens"] == 0
    entries = metric(http, "ragblend_prefix_cache_entries")
    assert query(http, mode="reuse", prefix_cache=False)["usage"]["prefix_cached_tokens"] == 0
    assert query(http, mode="reuse")["usage"]["prefix_cached_tokens"] == 0
    assert metric(http, "ragblend_prefix_cache_entries") == entries + 1


def test_reused_tokens_count_stored_chunk_kv_only(server, http):
    """Each source once (docs/api.md): the prompt's opening (chat header, system prompt) runs on KV the
    engine keeps for it, no stored chunk's, so it counts as computed. A first ask over chunks without KV
    reused ~20 tokens before (the opening's); now none, and with KV exactly the chunk's tokens."""
    cold = [{"id": f"cold-{mode}", "text": f"The green ferry number {i} to Faro leaves at seven and returns at noon."}
            for i, mode in enumerate(("reuse", "blend", "prefix"))]
    posted = http.post("/v1/documents", json={"documents": cold, "precompute": False}).json()["documents"]
    for document in posted:
        [chunk] = document["chunks"]
        assert not chunk["kv_cached"]
        mode = document["id"].removeprefix("cold-")  # asked once: a miss schedules the chunk's KV (a repair)
        answered = query(http, chunk_ids=[chunk["id"]], mode=mode, prefix_cache=False)
        usage = answered["usage"]
        assert answered["mode"] == mode and usage["reused_tokens"] == 0, (mode, usage)
        assert usage["recomputed_tokens"] == usage["prompt_tokens"] and usage["prefix_cached_tokens"] == 0
    vault = http.get("/v1/documents/vault").json()["chunks"][0]
    assert vault["kv_cached"]
    for mode in ("reuse", "blend"):
        usage = query(http, chunk_ids=["vault#0"], mode=mode, prefix_cache=False)["usage"]
        reused = vault["num_tokens"] if mode == "reuse" else usage["reused_tokens"]
        assert 0 < usage["reused_tokens"] == reused <= vault["num_tokens"], (mode, usage)
        assert usage["reused_tokens"] + usage["recomputed_tokens"] == usage["prompt_tokens"]


def test_a_chat_follow_up_reuses_the_turn_before_it(server, http):
    messages = [{"role": "user", "content": "Where does the vault stand?"}]
    first = chat(http, messages)
    answer = first["choices"][0]["message"]["content"]
    follow_up = chat(http, [*messages, {"role": "assistant", "content": answer},
                            {"role": "user", "content": "And the bridge?"}])
    usage = follow_up["usage"]
    assert usage["prefix_cached_tokens"] == first["usage"]["prompt_tokens"] < usage["prompt_tokens"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": usage["prefix_cached_tokens"]}
    assert usage["recomputed_tokens"] == usage["prompt_tokens"] - usage["prefix_cached_tokens"]
    assert follow_up["plan"]["plan"] == "prefix_cache"
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


@pytest.mark.parametrize("change", ["delete", "replace"])
def test_a_changed_document_drops_the_prompts_holding_its_chunks(server, http, change):
    doc = {"id": f"kept-{change}", "text": "The amber lighthouse of Vigo flashes twice every ten seconds."}
    assert http.post("/v1/documents", json={"documents": [doc]}).status_code == 201
    ids = [f"kept-{change}#0", "owls#0"]
    query(http, chunk_ids=ids)
    assert query(http, chunk_ids=ids)["usage"]["prefix_cached_tokens"] > 0
    other = query(http, chunk_ids=["owls#0"])  # kept too; holds none of the document's chunks
    before = metric(http, "ragblend_prefix_cache_invalidations_total")
    if change == "delete":
        assert http.delete(f"/v1/documents/{doc['id']}").status_code == 200
    else:
        changed = {**doc, "text": "The amber lighthouse of Vigo flashes three times every ten seconds."}
        assert http.post("/v1/documents", json={"documents": [changed]}).json()["documents"][0]["status"] == "replaced"
    assert metric(http, "ragblend_prefix_cache_invalidations_total") == before + 1
    assert http.post("/v1/documents", json={"documents": [doc]}).status_code == 201  # the same text again
    # dropped, not served: another kept prompt may share the tokens before the document's, not all of it
    num_before = len(server.components.engine.prompts.prefix_ids())
    num_chunk = http.get(f"/v1/documents/{doc['id']}").json()["chunks"][0]["num_tokens"]
    assert query(http, chunk_ids=ids)["usage"]["prefix_cached_tokens"] < num_before + num_chunk
    assert query(http, chunk_ids=["owls#0"])["usage"]["prefix_cached_tokens"] == other["usage"]["prompt_tokens"]

