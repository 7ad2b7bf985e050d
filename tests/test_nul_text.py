"""NUL characters (U+0000), which Postgres text and JSONB cannot hold, answered the same on both stores:
a JSON document whose title, text or metadata (keys too, at any depth) holds one is a 422 naming the
field, as are `chunk_ids` holding one; text extracted from an uploaded file has its NULs dropped (an
HTML title, a JSONL line's `\\u0000` escapes), and a JSONL line's metadata holding one is a 422 naming
the file and the field. Nothing of a refused request is stored; SQLite and a real Postgres
(tests/postgres_server.py), a tiny random model."""

from __future__ import annotations

import json

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def http(request, tmp_path_factory):
    database = {}
    if request.param == "postgres":
        database = {"url": request.getfixturevalue("postgres").new_database()}
    settings = load_settings(data_dir=tmp_path_factory.mktemp(f"nul-{request.param}"),
                             model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"chunking": "none"}, database=database)
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, timeout=120) as client:
        yield client


def assert_422(response: httpx.Response, *fragments: str) -> None:
    assert response.status_code == 422, response.text
    message = response.json()["error"]["message"]
    assert "NUL" in message, message
    for fragment in fragments:
        assert fragment in message, message


def num_documents(http: httpx.Client) -> int:
    return http.get("/v1/documents").json()["total"]


@pytest.mark.parametrize(("document", "field"), [
    ({"id": "t", "title": "Va\u0000ult", "text": "The vault code is 4812."}, "documents.0.title"),
    ({"id": "t", "text": "The vault\u0000 code is 4812."}, "documents.0.text"),
    ({"id": "t", "text": "The vault code is 4812.", "metadata": {"tags": ["ok", "b\u0000d"]}},
     "documents.0.metadata"),
    ({"id": "t", "text": "The vault code is 4812.", "metadata": {"deep": {"k\u0000ey": 1}}}, "documents.0.metadata"),
])
def test_a_json_document_holding_nul_is_a_422_naming_the_field(http, document, field):
    before = num_documents(http)
    fine = {"id": "fine", "text": "A fine document sent beside it."}
    response = http.post("/v1/documents", json={"documents": [fine, document]})
    assert_422(response, field.replace(".0.", ".1."))
    assert num_documents(http) == before and http.get("/v1/documents/fine").status_code == 404


def test_the_metadata_message_says_where(http):
    document = {"text": "The vault code is 4812.", "metadata": {"tags": ["ok", {"note": "b\u0000d"}]}}
    assert_422(http.post("/v1/documents", json={"documents": [document]}), "metadata.tags[1].note")


def test_chunk_ids_holding_nul_are_a_422(http):
    assert_422(http.post("/v1/query", json={"question": "What is the code?", "chunk_ids": ["vault\u0000#0"]}),
               "chunk_ids")
    chat = {"messages": [{"role": "user", "content": "What is the code?"}], "chunk_ids": ["\u0000"]}
    assert_422(http.post("/v1/chat/completions", json=chat), "chunk_ids")


def test_text_extracted_from_a_file_has_its_nuls_dropped(http):
    html = (b"<html><head><title>Bri\x00dges</title></head><body><h1>Bridges</h1>"
            b"<p>The red bridge in Lisbon was painted in 1966.\x00</p></body></html>")
    jsonl = json.dumps({"id": "line", "title": "Ti\u0000tle", "text": "The blue\u0000 door is in Porto."}).encode()
    response = http.post("/v1/documents/files", files=[("files", ("bridges.html", html)),
                                                       ("files", ("doors.jsonl", jsonl))])
    assert response.status_code == 201, response.text
    assert [d["title"] for d in response.json()["documents"]] == ["Bridges", "Title"]
    for doc_id, text in (("bridges.html", "painted in 1966."), ("line", "The blue door is in Porto.")):
        stored = http.get(f"/v1/documents/{doc_id}").json()
        assert "\x00" not in json.dumps(stored, ensure_ascii=False) and text in stored["chunks"][0]["text"]


def test_a_jsonl_lines_metadata_holding_nul_is_a_422_naming_the_file(http):
    before = num_documents(http)
    lines = [{"id": "good", "text": "A good line."}, {"id": "bad", "text": "A bad line.", "metadata": {"k": "\u0000"}}]
    jsonl = "\n".join(map(json.dumps, lines)).encode()
    assert_422(http.post("/v1/documents/files", files=[("files", ("rows.jsonl", jsonl))]), "rows.jsonl", "metadata.k")
    assert num_documents(http) == before and http.get("/v1/documents/good").status_code == 404
    assert http.post("/v1/documents", json={"documents": [{"text": "Still serving."}]}).status_code == 201
