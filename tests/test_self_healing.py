"""Self-healing KV and the documents API's truthfulness, on a live server with a tiny random model:
a damaged or missing entry found at a question is recomputed in the background (counted in
/metrics), `kv_cached` says what is really there, and ingest reports what it committed."""

from __future__ import annotations

import json
import logging
import re
import struct
import time

import httpx
import pytest
import torch

from app.testing import LiveServer
from blend_engine.kv import ChunkKV
from configs.settings import load_settings
from kv_store import codec

TEXT = "The violet zeppelin lands in Oslo every Tuesday. It carries forty passengers and a cat named Fred."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(
        data_dir=tmp_path_factory.mktemp("healing"),
        model={"name": "random:tiny-llama", "device": "cpu"},
        # disk only: damage there is not hidden by a memory copy, nor by the prefix cache's copy of the prompt
        store={"max_memory_bytes": 0, "prefix_cache_bytes": 0},
    )
    with LiveServer(settings) as live:
        yield live


def _metric(http: httpx.Client, name: str, **labels: str) -> float:
    selector = ",".join(f'{k}="{v}"' for k, v in labels.items())
    match = re.search(rf"^{name}\{{{selector}\}} (\S+)$", http.get("/metrics").text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _entry_path(server, doc_id: str):
    chunk = server.components.retriever.store.get_document(doc_id).chunks[0]
    return server.components.kv_store.backend("disk").path(chunk.kv_key)


def _wait_cached(http: httpx.Client, doc_id: str, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http.get(f"/v1/documents/{doc_id}").json()["chunks"][0]["kv_cached"]:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("damage", ["header", "missing"])
def test_an_entry_found_damaged_or_missing_at_a_question_is_rebuilt_in_the_background(server, damage):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        doc_id = f"zeppelin-{damage}"
        assert http.post("/v1/documents", json={"documents": [{"id": doc_id, "text": TEXT}]}).status_code == 201
        path = _entry_path(server, doc_id)
        corrupt_before = _metric(http, "ragblend_kv_corrupt_total", tier="disk")
        repairs_before = _metric(http, "ragblend_kv_repairs_total", how="background")
        if damage == "header":
            data = bytearray(path.read_bytes())
            data[20] ^= 0xFF  # inside the safetensors header: found when the question looks it up
            path.write_bytes(bytes(data))
        else:
            path.unlink()
        body = {"question": "Where does the zeppelin land?", "chunk_ids": [f"{doc_id}#0"], "max_tokens": 2,
                "mode": "reuse"}
        first = http.post("/v1/query", json=body)
        assert first.status_code == 200  # the chunk is computed fresh in this prompt (only the prefix is reused)
        assert _wait_cached(http, doc_id), "the entry was not rebuilt"
        assert _metric(http, "ragblend_kv_repairs_total", how="background") == repairs_before + 1
        assert _metric(http, "ragblend_kv_corrupt_total", tier="disk") == corrupt_before + (damage == "header")
        again = http.post("/v1/query", json=body).json()
        num_chunk_tokens = http.get(f"/v1/documents/{doc_id}").json()["chunks"][0]["num_tokens"]
        assert again["usage"]["reused_tokens"] == first.json()["usage"]["reused_tokens"] + num_chunk_tokens


def _crafted(server, doc_id: str, kind: str) -> bytes:
    """An entry for the document's first chunk, under its key, whose header parses but lies (or nests
    past any parser's recursion): what once answered 500 to every question and ingest of that text."""
    store = server.components.kv_store
    key = server.components.retriever.store.get_document(doc_id).chunks[0].kv_key
    real = _entry_path(server, doc_id).read_bytes()
    kv = store.get(key)  # the sound entry
    if kind == "one-token-short":
        kv = ChunkKV(kv.token_ids[:-1], kv.context_ids, kv.keys[:, :, :-1], kv.values[:, :, :-1])
    elif kind == "3000-kv-heads":  # a few KB of int4 that would decode to 3000 heads
        zeros = torch.zeros(kv.num_layers, 3000, kv.num_tokens, kv.keys.shape[3])
        kv = ChunkKV(kv.token_ids, kv.context_ids, zeros, zeros)
    else:  # nesting
        n = struct.unpack("<Q", real[:8])[0]
        table = json.loads(real[8 : 8 + n])
        depth = 100_000
        meta = table["__metadata__"][codec.META_KEY]
        table["__metadata__"][codec.META_KEY] = re.sub(r'"shape":\[[0-9,]*\]', '"shape":' + "[" * depth + "]" * depth,
                                                       meta)
        head = json.dumps(table).encode()
        return struct.pack("<Q", len(head)) + head + real[8 + n :]
    return codec.encode(kv, key, store.fingerprint, store.config.remote_format)


@pytest.mark.parametrize("kind", ["one-token-short", "3000-kv-heads", "nesting"])
def test_a_crafted_entry_heals_at_an_ingest_and_at_a_question(server, kind):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        doc_id = f"crafted-{kind}"
        document = {"documents": [{"id": doc_id, "text": f"{TEXT} Crafted: {kind}."}]}
        assert http.post("/v1/documents", json=document).status_code == 201
        path = _entry_path(server, doc_id)
        corrupt = _metric(http, "ragblend_kv_corrupt_total", tier="disk")
        path.write_bytes(_crafted(server, doc_id, kind))
        resent = http.post("/v1/documents", json=document)  # an unchanged document: its missing KV filled
        assert resent.status_code == 201 and resent.json()["documents"][0]["status"] == "unchanged"
        assert _metric(http, "ragblend_kv_corrupt_total", tier="disk") == corrupt + 1
        assert http.get(f"/v1/documents/{doc_id}").json()["chunks"][0]["kv_cached"]  # rebuilt by the ingest
        path.write_bytes(_crafted(server, doc_id, kind))
        body = {"question": "Where does the zeppelin land?", "chunk_ids": [f"{doc_id}#0"], "max_tokens": 2,
                "mode": "reuse"}
        assert http.post("/v1/query", json=body).status_code == 200
        assert _wait_cached(http, doc_id), "the entry was not rebuilt"
        assert _metric(http, "ragblend_kv_corrupt_total", tier="disk") == corrupt + 2
        assert http.post("/v1/query", json=body).status_code == 200


def test_kv_cached_tells_the_truth_about_a_damaged_entry(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        http.post("/v1/documents", json={"documents": [{"id": "truth", "text": TEXT + " Truly."}]})
        path = _entry_path(server, "truth")
        path.write_bytes(b"\0" * 64)  # exists, but is no entry
        assert http.get("/v1/documents/truth").json()["chunks"][0]["kv_cached"] is False


def test_ingest_reports_each_document_and_a_resend_is_a_no_op(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        batch = {"documents": [{"id": "r1", "text": "Red kites nest in Wales."}, {"text": "Blue whales sing."}]}
        first = http.post("/v1/documents", json=batch).json()["documents"]
        assert [d["status"] for d in first] == ["created", "created"]
        second = http.post("/v1/documents", json=batch).json()["documents"]
        assert [d["status"] for d in second] == ["unchanged", "unchanged"]
        assert [d["id"] for d in second] == [d["id"] for d in first]  # an id-less document keeps its id
        assert [c["id"] for c in second[0]["chunks"]] == [c["id"] for c in first[0]["chunks"]]
        batch["documents"][0]["text"] = "Red kites nest in Scotland now."
        assert http.post("/v1/documents", json=batch).json()["documents"][0]["status"] == "replaced"
        listed = http.get("/v1/documents", params={"limit": 1000}).json()
        assert listed["total"] == len(listed["documents"])
        assert {"r1", first[1]["id"]} <= {d["id"] for d in listed["documents"]}


def test_a_re_upload_of_the_same_file_is_unchanged(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        files = {"files": ("herons.txt", b"Grey herons wait in shallow water.", "text/plain")}
        first = http.post("/v1/documents/files", files=files).json()["documents"][0]
        second = http.post("/v1/documents/files", files=files).json()["documents"][0]
        assert (first["status"], second["status"]) == ("created", "unchanged") and first["id"] == second["id"]


def test_a_batch_failing_part_way_names_the_documents_committed_before(server, monkeypatch):
    writer = server.components.documents.writer
    real_write = writer.write

    def failing_write(doc, chunking, precompute, collection):
        if doc.id == "second":
            raise RuntimeError("disk on fire")
        return real_write(doc, chunking, precompute, collection)

    monkeypatch.setattr(writer, "write", failing_write)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        batch = {"documents": [{"id": "first", "text": "Owls hunt at night."}, {"id": "second", "text": "Bats too."}]}
        response = http.post("/v1/documents", json=batch)
        assert response.status_code == 500
        message = response.json()["error"]["message"]
        assert "stopped at document second" in message and "committed before it: first" in message
        assert "RuntimeError" not in message and "disk on fire" not in message and "error id" in message
        assert http.get("/v1/documents/first").status_code == 200
        assert http.get("/v1/documents/second").status_code == 404


def test_a_delete_of_no_such_document_is_a_404_not_a_failed_engine_job(server, caplog):
    with httpx.Client(base_url=server.url, timeout=60) as http, caplog.at_level(logging.WARNING):
        failed = _metric(http, "ragblend_engine_jobs_total", outcome="failed")
        response = http.delete("/v1/documents/no-such-document")
        assert response.status_code == 404 and "no-such-document" in response.json()["error"]["message"]
        assert _metric(http, "ragblend_engine_jobs_total", outcome="failed") == failed
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
