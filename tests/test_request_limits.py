"""Limits that depend on the model: a document's KV against the store's bound (start-up and ingest,
without the collection's KV budget: `store.budgeted: false`), and a prompt that cannot fit the context
because of the chat history, said as such."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from app.documents.limits import KVBudget, check_document_limit
from app.documents.protocol import IngestRequest
from app.errors import InvalidRequestError, PayloadTooLargeError
from app.rag.pipeline import RagPipeline
from app.rag.types import RagRequest
from blend_engine.loader import embedded_tokenizer_dir
from blend_engine.prompt import PromptBuilder
from blend_engine.types import PrefillMode, SamplingParams
from configs.settings import load_settings

# SmolLM2-135M's KV shape: 30 layers, 3 KV heads of 64 -> 23 040 bytes per token in float16
ENGINE = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64, tokenize=lambda text: text.split())
BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2


UNBUDGETED = {"budgeted": False, "quantization": "none"}  # the old regime, in float16


def budget(**store) -> KVBudget | None:
    return KVBudget.of(load_settings(store={**UNBUDGETED, **store}, retrieval={"chunking": "none"}), ENGINE)


def test_with_the_collections_kv_budget_no_document_is_refused_for_its_kv():
    settings = load_settings(limits={"max_document_chars": 1_000_000}, store={"max_disk_bytes": 1000})
    assert KVBudget.of(settings, ENGINE) is None
    check_document_limit(settings, ENGINE)  # ingestion precomputes into free room; the rest on use


def test_the_bound_is_the_tier_chunk_caches_live_in():
    disk = budget()
    assert disk.setting == "store.max_disk_bytes" and disk.bytes_per_token == BYTES_PER_TOKEN
    assert BYTES_PER_TOKEN // 2 < budget(quantization="int8").bytes_per_token < BYTES_PER_TOKEN // 2 + 64  # + scales
    assert budget(quantization="int4").bytes_per_token < BYTES_PER_TOKEN * 0.3  # its bound before zstd
    memory = budget(disk_enabled=False)
    assert memory.setting == "store.max_memory_bytes" and memory.capacity_bytes == 2 << 30
    assert budget(disk_enabled=False, redis_url="redis://127.0.0.1:1/0") is None


def test_start_up_refuses_a_document_limit_whose_kv_cannot_fit():
    check_document_limit(load_settings(store=UNBUDGETED), ENGINE)  # the defaults fit
    too_big = load_settings(limits={"max_document_chars": 1_000_000}, store=UNBUDGETED)
    with pytest.raises(ValueError, match=r"max_document_chars=1000000 .* over store.max_disk_bytes=21474836480"):
        check_document_limit(too_big, ENGINE)
    with pytest.raises(ValueError, match="store.max_memory_bytes"):
        check_document_limit(load_settings(store={"disk_enabled": False, **UNBUDGETED}), ENGINE)


def ingest(*texts: str, precompute: bool = True) -> IngestRequest:
    return IngestRequest(documents=[{"id": f"d{i}", "text": t} for i, t in enumerate(texts)], precompute=precompute)


def test_ingest_rejects_a_document_or_batch_whose_kv_cannot_fit_with_the_numbers():
    small = budget(max_disk_bytes=100 * BYTES_PER_TOKEN)  # room for 100 tokens
    asyncio.run(small.check_request(ingest("word " * 100)))
    with pytest.raises(PayloadTooLargeError, match=r"document d0 has 101 tokens: their KV needs 0.0 GB \(23040 "
                                                   r"bytes per token\), over the store's bound store.max_disk_bytes"):
        asyncio.run(small.check_request(ingest("word " * 101)))
    with pytest.raises(PayloadTooLargeError, match="the 2 documents have 120 tokens"):
        asyncio.run(small.check_request(ingest("word " * 60, "word " * 60)))
    asyncio.run(small.check_request(ingest("word " * 500, precompute=False)))  # nothing stored at ingest


def test_chunk_overlap_counts_against_the_bound():
    settings = load_settings(retrieval={"chunk_tokens": 100, "chunk_overlap": 50}, store=UNBUDGETED)
    assert KVBudget.of(settings, ENGINE).needed_bytes(1000, settings.retrieval.chunking) == 2000 * BYTES_PER_TOKEN


def test_a_too_long_chat_history_is_reported_as_such():
    tokenizer = AutoTokenizer.from_pretrained(embedded_tokenizer_dir(load_settings().model.cache_dir))
    engine = SimpleNamespace(max_context=200, prompts=PromptBuilder(tokenizer, "Be brief."))
    pipeline = RagPipeline(load_settings(), engine, retriever=None, kv_store=None, loop=None)
    history = ({"role": "user", "content": "tell me more " * 80}, {"role": "assistant", "content": "ok"})
    request = RagRequest("What is it?", PrefillMode.BLEND, SamplingParams(max_tokens=8), history=history)
    with pytest.raises(InvalidRequestError, match=r"the chat history \(2 messages, \d+ tokens\) with the question "
                                                  r"needs \d+ prompt tokens.*shorten the history"):
        pipeline._fit_context(request, [])
    long_question = RagRequest("why " * 300, PrefillMode.BLEND, SamplingParams(max_tokens=8))
    with pytest.raises(InvalidRequestError, match="the question alone needs"):
        pipeline._fit_context(long_question, [])


def test_uploaded_files_meet_the_same_kv_bound(tmp_path):
    """The upload route applies the JSON route's KV budget: a batch of files whose KV cannot fit is a
    413 with the numbers, and nothing is stored."""
    import httpx

    from app.testing import LiveServer
    from blend_engine.engine import BlendEngine

    base = dict(data_dir=tmp_path, model={"name": "random:tiny-llama", "device": "cpu"},
                retrieval={"chunking": "none"}, limits={"max_document_chars": 100})
    engine = BlendEngine.from_config(load_settings(**base).model)
    per_token = KVBudget.of(load_settings(**base, store=UNBUDGETED), engine).bytes_per_token
    settings = load_settings(**base, store={"max_disk_bytes": 150 * per_token, "max_memory_bytes": 0, **UNBUDGETED})
    text = ("#%&" * 30).encode()  # ~90 tokens a file: two do not fit 150 tokens of KV
    with LiveServer(settings, engine=engine) as live, httpx.Client(base_url=live.url, timeout=120) as http:
        files = [("files", ("a.txt", text)), ("files", ("b.txt", text))]
        refused = http.post("/v1/documents/files", files=files)
        assert refused.status_code == 413, refused.text
        assert "store.max_disk_bytes" in refused.json()["error"]["message"]
        assert http.get("/v1/documents").json()["total"] == 0
        assert http.post("/v1/documents/files", files=files[:1]).status_code == 201


def test_a_huge_chat_history_is_refused_by_size_before_anything_is_tokenized():
    """A 7 MB history used to be tokenized (once per chunk the context fit dropped) before its 422: the
    request is now refused by its sizes in build_rag_request, before retrieval or any tokenizer runs."""
    from app.chat.protocol import ChatCompletionRequest
    from app.query.serving import build_rag_request

    settings = load_settings(limits={"max_history_chars": 1000, "max_history_messages": 3})
    options = ChatCompletionRequest(messages=[{"role": "user", "content": "q"}])
    huge = [{"role": "user", "content": "tell me more " * 550_000}]  # 7.2 MB
    with pytest.raises(InvalidRequestError, match=r"7150000 characters; the limit is 1000 \(limits.max_history_chars\)"):
        build_rag_request(settings, "What is it?", options, history=huge)
    many = [{"role": "user", "content": "hi"}] * 4
    with pytest.raises(InvalidRequestError, match=r"4 earlier messages; the limit is 3 \(limits.max_history_messages\)"):
        build_rag_request(settings, "What is it?", options, history=many)
    fits = [{"role": "user", "content": "x" * 500}, {"role": "assistant", "content": "y" * 500}]
    assert build_rag_request(settings, "What is it?", options, history=fits).history == tuple(fits)
