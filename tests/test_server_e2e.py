"""End to end over real HTTP on loopback, with the real SmolLM2 and MiniLM: ingest, ask in blend and
full, stream, the official openai client, chunk_ids, context fitting, delete/replace and restart."""

from __future__ import annotations

import json

import httpx
import pytest
from openai import OpenAI

from app.commands.ask import iter_events
from app.testing import LiveServer
from blend_engine.config import ModelConfig
from blend_engine.engine import BlendEngine
from configs.settings import load_settings

pytestmark = pytest.mark.smollm2

QUESTION = "What is the secret code of the blue vault?"
DOCUMENTS = [
    {"id": "vault", "title": "Vault", "text": "The secret code of the blue vault is 4812."},
    {"id": "bridge", "text": "The red bridge in Lisbon was painted in 1966 by a team of forty workers."},
    {"id": "mountain", "text": "Mount Kosciuszko is the highest mountain in mainland Australia."},
    {"id": "cheese", "text": "The annual cheese festival takes place in the village of Wensleydale every October."},
]


def make_settings(data_dir, **overrides):
    # the prefix cache off: these tests ask the same questions again and check the chunks' KV path
    # (tests/test_prefix_server.py tests the prefix cache); no relevance floor: they count on every retrieved
    # chunk reaching the prompt (top_k, context fitting, KV loads; the floor's tests: tests/test_retrieval_api.py)
    overrides.setdefault("store", {}).setdefault("prefix_cache_bytes", 0)
    retrieval = {"min_score": -1.0, "score_margin": 2.0, **overrides.pop("retrieval", {})}
    return load_settings(data_dir=data_dir, limits={"max_tokens": 8192}, retrieval=retrieval, **overrides)


@pytest.fixture(scope="module")
def engine():
    return BlendEngine.from_config(ModelConfig(name="smollm2"))


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    with LiveServer(make_settings(tmp_path_factory.mktemp("e2e")), engine=engine) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=300) as http:
        response = http.post("/v1/documents", json={"documents": DOCUMENTS})
        assert response.status_code == 201, response.text
        yield http


def ask(client, **body) -> dict:
    response = client.post("/v1/query", json={"question": QUESTION, "max_tokens": 20, "top_k": 3, **body})
    assert response.status_code == 200, response.text
    return response.json()


def kv_hits(client, tier: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'ragblend_kv_hits_total{{tier="{tier}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no KV hit counter for tier {tier}")


def test_ingestion_reports_chunks_with_cached_kv(client):
    listing = client.get("/v1/documents").json()
    assert listing["total"] == 4 and {d["id"] for d in listing["documents"]} == {d["id"] for d in DOCUMENTS}
    vault = client.get("/v1/documents/vault").json()
    assert vault["title"] == "Vault" and vault["chunks"][0]["kv_cached"] is True
    assert vault["chunks"][0]["text"] == DOCUMENTS[0]["text"]


@pytest.mark.parametrize("mode", ["full", "blend"])
def test_answer_and_sources_are_right_in_full_and_blend(client, mode):
    hits_before = kv_hits(client, "memory") + kv_hits(client, "disk")
    body = ask(client, mode=mode)
    assert "4812" in body["answer"] and body["mode"] == mode
    assert body["sources"][0]["document_id"] == "vault" and body["sources"][0]["title"] == "Vault"
    assert len(body["sources"]) == 3 and body["sources"][0]["score"] > body["sources"][1]["score"]
    usage, timings = body["usage"], body["timings"]
    assert 0 < usage["completion_tokens"] <= 20
    assert usage["reused_tokens"] + usage["recomputed_tokens"] == usage["prompt_tokens"]
    assert 0 < timings["ttft_ms"] <= timings["total_ms"] and timings["prefill_ms"] > 0
    if mode == "blend":  # the retrieved chunks' KV came from the store
        assert usage["reused_tokens"] > 0 and kv_hits(client, "memory") + kv_hits(client, "disk") > hits_before
    else:
        assert usage["reused_tokens"] == 0


def test_prefix_mode_and_auto_ratio_answer_and_metrics_track_ttft_per_mode(client):
    assert "4812" in ask(client, mode="prefix")["answer"]
    body = ask(client, mode="blend", recompute_ratio="auto")
    assert "4812" in body["answer"] and 0.15 <= body["recompute_ratio"] <= 1.0
    metrics = client.get("/metrics").text
    for mode in ("full", "blend", "prefix"):
        assert f'ragblend_ttft_seconds_count{{mode="{mode}"}}' in metrics
    assert 'ragblend_prompt_tokens_total{kind="reused"}' in metrics
    assert 'ragblend_requests_total{method="POST",route="/v1/query",status="200"}' in metrics


def test_streamed_query_sends_sources_tokens_then_done(client):
    with client.stream("POST", "/v1/query", json={"question": QUESTION, "max_tokens": 16, "stream": True}) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = list(iter_events(response.iter_lines()))
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "sources" and kinds[-1] == "done" and set(kinds[1:-1]) == {"token"}
    assert events[0][1]["sources"][0]["document_id"] == "vault"
    answer = "".join(data["text"] for kind, data in events if kind == "token")
    done = events[-1][1]
    assert "4812" in answer and 0 < done["usage"]["completion_tokens"] <= 16
    assert done["mode"] == "blend" and done["usage"]["reused_tokens"] > 0 and done["timings"]["ttft_ms"] > 0


def test_chunk_ids_skip_retrieval_and_keep_their_order(client):
    body = ask(client, chunk_ids=["cheese#0", "vault#0"], mode="reuse")
    assert [s["chunk_id"] for s in body["sources"]] == ["cheese#0", "vault#0"]
    assert all(s["score"] is None for s in body["sources"]) and body["usage"]["reused_tokens"] > 0
    assert client.post("/v1/query", json={"question": QUESTION, "chunk_ids": ["nope#0"]}).status_code == 404


def test_openai_client_chat_completions_carry_sources(server, client):
    openai = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = openai.models.list().data[0].id
    messages = [{"role": "user", "content": QUESTION}]
    extra = {"top_k": 2, "mode": "blend"}
    completion = openai.chat.completions.create(model=model, messages=messages, max_tokens=20, extra_body=extra)
    assert "4812" in completion.choices[0].message.content and completion.usage.completion_tokens > 0
    assert completion.model_extra["sources"][0]["document_id"] == "vault"
    chunks = list(openai.chat.completions.create(model=model, messages=messages, max_tokens=20, stream=True,
                                                 extra_body=extra))
    assert chunks[0].model_extra["sources"][0]["chunk_id"] == "vault#0"
    assert "4812" in "".join(c.choices[0].delta.content or "" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in {"stop", "length"}
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].usage.model_extra["reused_tokens"] > 0


def test_prompt_is_fitted_to_the_context_by_dropping_the_lowest_scored(server, client, engine):
    from blend_engine.types import Segment

    vault_ids = tuple(engine.tokenize(DOCUMENTS[0]["text"]))
    num_with_vault = sum(len(s.token_ids) for s in engine.build_segments(QUESTION, [Segment(vault_ids)]))
    body = {"model": server.components.model_id, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": engine.max_context - num_with_vault, "top_k": 3, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        first = json.loads(next(response.iter_lines()).removeprefix("data: "))
    assert [s["chunk_id"] for s in first["sources"]] == ["vault#0"]
    assert "dropped 2 lowest-ranked" in first["warnings"][0]


def test_long_documents_are_chunked_by_llm_tokens_and_uncached_chunks_still_answer(server, client, engine):
    sentences = " ".join(f"Fact number {i}: the lighthouse keeper counted {i * 7} gulls on day {i}." for i in range(150))
    body = {"documents": [{"id": "gulls", "text": sentences}], "precompute": False}
    chunks = client.post("/v1/documents", json=body).json()["documents"][0]["chunks"]
    limit = server.settings.retrieval.chunk_tokens
    assert len(chunks) >= 3 and all(0 < c["num_tokens"] <= limit and not c["kv_cached"] for c in chunks)
    stored = client.get("/v1/documents/gulls").json()["chunks"]
    assert all(c["text"].startswith("Fact number") and c["text"].endswith(".") for c in stored)
    assert len(engine.tokenize(stored[0]["text"])) == stored[0]["num_tokens"]
    body = ask(client, question=QUESTION, chunk_ids=["vault#0", "gulls#0"], mode="reuse")
    num_vault = len(engine.tokenize(DOCUMENTS[0]["text"]))
    assert body["answer"] and body["usage"]["reused_tokens"] == num_vault
    assert client.delete("/v1/documents/gulls").status_code == 200


def test_deleted_and_replaced_documents_are_never_retrieved_and_their_kv_is_gone(server, client):
    kv_store = server.components.kv_store
    client.post("/v1/documents", json={"documents": [{"id": "pet", "text": "The green parrot is named Kiwi."}]})
    old_key = server.components.retriever.store.chunks_by_ids(["pet#0"])["pet#0"].kv_key
    assert kv_store.contains(old_key)
    replaced = client.post("/v1/documents", json={"documents": [{"id": "pet", "text": "The green parrot is named Mango."}]})
    assert replaced.status_code == 201 and not kv_store.contains(old_key)
    body = ask(client, question="What is the green parrot named?", top_k=5, mode="full")
    assert "Mango" in " ".join(s["text"] for s in body["sources"]) and "Kiwi" not in json.dumps(body["sources"])
    new_key = server.components.retriever.store.chunks_by_ids(["pet#0"])["pet#0"].kv_key
    deleted = client.delete("/v1/documents/pet")
    assert deleted.status_code == 200 and deleted.json()["num_chunks"] == 1
    assert client.get("/v1/documents/pet").status_code == 404 and client.delete("/v1/documents/pet").status_code == 404
    assert not kv_store.contains(new_key)
    body = ask(client, question="What is the green parrot named?", top_k=10, mode="full")
    assert all(s["document_id"] != "pet" for s in body["sources"])


def test_restart_keeps_documents_and_loads_their_kv_from_disk(engine, tmp_path):
    settings = make_settings(tmp_path)
    with LiveServer(settings, engine=engine) as first, httpx.Client(base_url=first.url, timeout=300) as http:
        assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
    with LiveServer(settings, engine=engine) as second, httpx.Client(base_url=second.url, timeout=300) as http:
        assert http.get("/readyz").json()["num_chunks"] == 4
        assert http.get("/v1/documents/vault").json()["chunks"][0]["kv_cached"] is True
        assert kv_hits(http, "disk") == 0
        body = ask(http, mode="blend")
        assert "4812" in body["answer"] and body["sources"][0]["document_id"] == "vault"
        assert body["usage"]["reused_tokens"] > 0 and kv_hits(http, "disk") >= 3  # loaded, not recomputed
        # streamed from disk, then promoted: the next question finds them in memory
        memory_hits = kv_hits(http, "memory")
        assert "4812" in ask(http, mode="blend")["answer"]
        assert kv_hits(http, "memory") >= memory_hits + 3


def test_cli_ingest_and_ask_talk_to_the_server(server, client, tmp_path, capsys):
    from app.cli import main

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "owl.md").write_text("# Owls\n\nThe snowy owl of the north tower is called Hedwig.\n")
    (tmp_path / "docs" / "more.jsonl").write_text(json.dumps({"id": "fox", "text": "The red fox sleeps in the barn."}))
    assert main(["ingest", str(tmp_path / "docs"), "--url", server.url]) == 0
    assert "ingested 2 documents, 2 chunks" in capsys.readouterr().out
    assert client.get("/v1/documents/owl").json()["title"] == "Owls"
    assert main(["ask", "What is the snowy owl of the north tower called?", "--url", server.url,
                 "--max-tokens", "16", "--top-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "Hedwig" in out.split("Sources:")[0] and "[1] owl#0 Owls" in out
    assert main(["ask", "anything", "--url", server.url, "--top-k", "100000"]) == 1
    assert "top_k" in capsys.readouterr().err
    for doc_id in ("owl", "fox"):
        client.delete(f"/v1/documents/{doc_id}")


def test_server_modes_bench_reports_every_mode_and_ends_with_json(server, tmp_path, capsys):
    from app.cli import main

    item = {"question": QUESTION, "answers": ["4812"], "ctxs": [{"title": "Vault", "text": DOCUMENTS[0]["text"]},
                                                                {"title": "Bridge", "text": DOCUMENTS[1]["text"]}]}
    (tmp_path / "mini.json").write_text(json.dumps([item]))
    assert main(["bench", "server-modes", "--url", server.url, "--data", str(tmp_path / "mini.json"),
                 "--questions", "1", "--passages", "2", "--max-tokens", "6", "--concurrency", "1",
                 "--throughput-rounds", "2", "--out", str(tmp_path / "b.json")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["results"]) == {"full", "blend", "reuse"} and summary["blend_ttft_speedup_vs_full"] > 0
    assert summary["results"]["full"]["f1_vs_full"] == 1.0 and summary["results"]["blend"]["throughput_rps"] > 0
    assert summary["results"]["blend"]["median_reused_tokens"] > 0 and summary["results"]["full"]["median_reused_tokens"] == 0
    assert summary["results"]["full"]["throughput_rps"] == summary["throughput"]["modes"]["full"]["requests_per_s"]
    assert summary["results"]["reuse"]["throughput_rps"] is None  # not a throughput mode
    assert summary["throughput"]["ratios"]["blend/full"]["requests_per_s"]["median"] > 0
    assert json.loads((tmp_path / "b.json").read_text()) == summary


def test_selection_and_adaptive_ratio_per_request(client):
    body = ask(client, mode="blend", selection="query", recompute_ratio="adaptive")
    assert "4812" in body["answer"] and 0.05 <= body["recompute_ratio"] <= 0.5 and not body["quality_guarded"]
    # a deviation ranking answers under the defaults (check layer 0): the config is fitted to check at layer 1
    # (test_engine_selection::test_fitted_configs_suit_the_model)
    body = ask(client, mode="blend", selection="deviation", recompute_ratio=0.5)
    assert "4812" in body["answer"] and body["recompute_ratio"] == pytest.approx(0.5, abs=0.01)  # the share that ran
    chat = client.post("/v1/chat/completions", json={
        "model": client.get("/v1/models").json()["data"][0]["id"], "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 12,
        "selection": "query_chunk_start", "recompute_ratio": 0.3})
    assert chat.status_code == 200, chat.text
    assert chat.json()["recompute_ratio"] == pytest.approx(0.3, abs=0.01)
    bad = client.post("/v1/query", json={"question": QUESTION, "selection": "random"})
    assert bad.status_code in (400, 422) and "selection" in bad.text


def test_quality_guard_says_when_it_raised_the_ratio(engine, tmp_path):
    settings = make_settings(tmp_path, blend={"guard_unselected_mass": 0.0, "guard_ratio": 0.6})
    with LiveServer(settings, engine=engine) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
        body = ask(http, mode="blend")
        assert body["quality_guarded"] and body["recompute_ratio"] == pytest.approx(0.6, abs=0.01)
        assert "4812" in body["answer"]


def test_auto_mode_is_the_default_and_reports_its_plan(client):
    body = ask(client)  # no mode: the loading planner decides; chunks in memory load for free
    plan = body["plan"]
    assert body["mode"] == "blend" and plan["plan"] == "blend" and plan["recompute_ratio"] == pytest.approx(0.15)
    assert plan["predicted_compute_ms"] > 0 and plan["actual_prefill_ms"] > 0 and plan["num_chunks_recomputed"] == 0
    assert "4812" in body["answer"]
    assert ask(client, mode="full")["plan"] is None  # an explicit mode is honoured, not planned
    assert 'ragblend_load_plans_total{plan="blend"}' in client.get("/metrics").text


def test_auto_mode_falls_back_to_full_when_the_tier_is_slow(engine, tmp_path):
    # only a disk tier, slowed to 0.1 MB/s (int4 entries are ~4x smaller than float16's: at 0.5 MB/s
    # loading them is cheap enough to blend): the first answer measures it, the next ones skip loading
    settings = make_settings(tmp_path, store={"max_memory_bytes": 0, "throttle_mbps": {"disk": 0.1}})
    with LiveServer(settings, engine=engine) as live, httpx.Client(base_url=live.url, timeout=300) as http:
        assert http.post("/v1/documents", json={"documents": DOCUMENTS}).status_code == 201
        ask(http)
        body = ask(http)
        assert body["mode"] == "full" and body["plan"]["plan"] == "full" and body["plan"]["predicted_load_ms"] == 0
        assert body["usage"]["reused_tokens"] == 0 and "4812" in body["answer"]
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                       "max_tokens": 8}).json()
        assert chat["plan"]["plan"] == "full"
        assert 'ragblend_load_plans_total{plan="full"}' in http.get("/metrics").text


def test_openai_client_penalties_are_accepted_and_honoured(server, client):
    """OpenAI's frequency_penalty and presence_penalty (a 400 before) and the extras repetition_penalty and
    no_repeat_ngram_size change a 40-token answer (ignore_eos: the same length whatever the model says,
    the configured stop strings left out); outside OpenAI's range, a 422. (The same answer twice is not
    compared: the CPU engine's thread count follows the load, and past the end of sequence the greedy
    choices are near ties that a thread count can flip.)"""
    import openai as openai_module

    openai = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = openai.models.list().data[0].id

    def answer(**penalties) -> str:
        extra = {"top_k": 2, "mode": "blend", "ignore_eos": True}
        extra.update({k: penalties.pop(k) for k in ("repetition_penalty", "no_repeat_ngram_size") if k in penalties})
        completion = openai.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                    max_tokens=40, extra_body=extra, **penalties)
        assert completion.usage.completion_tokens == 40
        return completion.choices[0].message.content

    plain = answer(no_repeat_ngram_size=0)
    for penalty in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.5},
                    {"no_repeat_ngram_size": 2}):
        assert answer(**{"no_repeat_ngram_size": 0, **penalty}) != plain, penalty
    with pytest.raises(openai_module.UnprocessableEntityError, match="presence_penalty"):
        answer(presence_penalty=2.5)
