"""Isolation between knowledge bases over real HTTP, on SQLite and on a real Postgres (tiny random model,
real MiniLM): three scoped keys (read, write, admin), each bound to one of three collections, against
every route and every collection. A key reaches its own collection as its role allows (403 only for
what its role forbids there), and another collection's documents, chunks and names read exactly as
ones that do not exist (404 with the same message); no answer cites, no list shows, no model name
reveals another collection; only the server's key manages keys and collections and reads /metrics,
whose text names no collection or document."""

from __future__ import annotations

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings

ADMIN = {"Authorization": "Bearer the-server-key"}
# distinctive names, so a leak into /metrics or an error message cannot pass for another word
COLLECTIONS = {"kbhr7f": ("read", "Payroll closes on the 25th; annual leave is 31 days for every employee."),
               "kbeng7f": ("write", "The deploy pipeline runs canary releases on Tuesdays at 14:00 UTC."),
               "kbops7f": ("admin", "The on-call rotation hands over every Monday at 09:00 in Lisbon.")}
QUESTIONS = {"kbhr7f": "How many days of annual leave?", "kbeng7f": "When do canary releases run?",
             "kbops7f": "When does the on-call rotation hand over?"}
UNKNOWN = "kbnone7f"


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def server(request, tmp_path_factory):
    database = {"url": request.getfixturevalue("postgres").new_database()} if request.param == "postgres" else {}
    settings = load_settings(
        data_dir=tmp_path_factory.mktemp(f"isolation-{request.param}"), model={"name": "random:tiny-llama", "device": "cpu"},
        server={"api_key": "the-server-key"}, generation={"max_tokens": 1},
        # no relevance floor, nor a refusal of names no searched chunk mentions (tests/test_lexical.py): a
        # question about another collection's text still gets the key's own chunks (what is checked here is
        # whose chunks a key can see, not their relevance)
        retrieval={"chunking": "none", "min_score": -1.0, "score_margin": 2.0, "refuse_unmentioned_names": False},
        database=database)
    with LiveServer(settings) as live, httpx.Client(base_url=live.url, headers=ADMIN, timeout=120) as admin:
        live.keys = {}
        for name, (role, text) in COLLECTIONS.items():
            assert admin.post("/v1/collections", json={"name": name}).status_code == 201
            ingest(admin, name, text)
            created = admin.post("/v1/keys", json={"name": f"{role} key", "role": role, "collections": [name]})
            assert created.status_code == 201, created.text
            live.keys[name] = {"Authorization": f"Bearer {created.json()['key']}"}
        yield live


def ingest(http: httpx.Client, collection: str, text: str, headers: dict | None = None) -> httpx.Response:
    response = http.post("/v1/documents", headers=headers, json={
        "collection": collection, "documents": [{"id": f"{collection}-doc", "title": f"{collection} notes", "text": text},
                                                {"id": "same-id", "text": f"{text} (again)"}]})
    assert response.status_code == 201 or headers is not None, response.text
    return response


def assert_error(response: httpx.Response, status: int, message: str) -> None:
    assert response.status_code == status, (response.request.method, response.request.url, response.text)
    assert response.json()["error"]["message"] == message, response.text


def test_every_key_against_every_collection_on_every_route(server):
    model = httpx.get(f"{server.url}/v1/models", headers=ADMIN).json()["data"][0]["id"]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for own, (role, _) in COLLECTIONS.items():
            key = server.keys[own]
            for target in COLLECTIONS:
                if target == own:
                    check_own(http, key, role, own, model)
                else:
                    check_other(http, key, target, model)
            check_unscoped_defaults(http, key, own, model)


def check_own(http: httpx.Client, key: dict, role: str, name: str, model: str) -> None:
    asked = http.post("/v1/query", headers=key, json={"question": QUESTIONS[name], "collection": name, "top_k": 5})
    assert asked.status_code == 200 and {s["collection"] for s in asked.json()["sources"]} == {name}
    for body in ({"model": f"{model}:{name}"}, {"collection": [name]}):
        chat = http.post("/v1/chat/completions", headers=key,
                         json={**body, "messages": [{"role": "user", "content": QUESTIONS[name]}]})
        assert chat.status_code == 200 and {s["collection"] for s in chat.json()["sources"]} == {name}, chat.text
    completion = http.post("/v1/completions", headers=key, json={"model": f"{model}:{name}", "prompt": QUESTIONS[name]})
    assert completion.status_code == 200 and {s["collection"] for s in completion.json()["sources"]} == {name}
    listed = http.get("/v1/documents", headers=key, params={"collection": name}).json()
    assert {(d["id"], d["collection"]) for d in listed["documents"]} == {(f"{name}-doc", name), ("same-id", name)}
    assert http.get(f"/v1/documents/{name}-doc", headers=key).json()["collection"] == name
    assert http.get("/v1/documents/same-id", headers=key, params={"collection": name}).status_code == 200
    assert http.get(f"/v1/collections/{name}", headers=key).json()["access"] == role
    writes_allowed = role in ("write", "admin")
    ingested = ingest(http, name, COLLECTIONS[name][1], headers=key)
    assert ingested.status_code == (201 if writes_allowed else 403), ingested.text
    uploaded = http.post("/v1/documents/files", headers=key, data={"collection": name},
                         files={"files": ("extra.txt", b"An extra note.", "text/plain")})
    assert uploaded.status_code == (201 if writes_allowed else 403), uploaded.text
    deleted = http.delete("/v1/documents/extra.txt", headers=key)
    assert deleted.status_code == (200 if writes_allowed else 404)  # a read key's upload never landed
    if not writes_allowed:
        assert_error(http.delete(f"/v1/documents/{name}-doc", headers=key), 403,
                     f"this key's role (read) may not change documents in collection {name}")
    patched = http.patch(f"/v1/collections/{name}", headers=key, json={"description": "mine"})
    assert patched.status_code == (200 if role == "admin" else 403), patched.text
    if role != "admin":
        assert http.delete(f"/v1/collections/{name}", headers=key).status_code == 403


def check_other(http: httpx.Client, key: dict, other: str, model: str) -> None:
    """Every route answers about another collection exactly as about one that does not exist."""
    for name in (other, UNKNOWN):
        gone = f"collection not found: {name}"
        assert_error(http.post("/v1/query", headers=key, json={"question": "anything?", "collection": name}), 404, gone)
        assert_error(http.post("/v1/chat/completions", headers=key, json={
            "model": f"{model}:{name}", "messages": [{"role": "user", "content": "anything?"}]}), 404, gone)
        assert_error(http.post("/v1/chat/completions", headers=key, json={
            "collection": name, "messages": [{"role": "user", "content": "anything?"}]}), 404, gone)
        assert_error(http.post("/v1/completions", headers=key, json={"model": f"{model}:{name}", "prompt": "x?"}), 404, gone)
        assert_error(http.get("/v1/documents", headers=key, params={"collection": name}), 404, gone)
        assert_error(http.get(f"/v1/documents/{name}-doc", headers=key, params={"collection": name}), 404, gone)
        assert_error(http.delete(f"/v1/documents/{name}-doc", headers=key, params={"collection": name}), 404, gone)
        assert_error(ingest(http, name, "Planted text.", headers=key), 404, gone)
        assert_error(http.post("/v1/documents/files", headers=key, data={"collection": name},
                               files={"files": ("planted.txt", b"Planted.", "text/plain")}), 404, gone)
        assert_error(http.get(f"/v1/collections/{name}", headers=key), 404, gone)
        assert_error(http.patch(f"/v1/collections/{name}", headers=key, json={"description": "x"}), 404, gone)
        assert_error(http.delete(f"/v1/collections/{name}", headers=key), 404, gone)
        # its documents by id alone, and its chunks by id: as if they did not exist
        assert_error(http.get(f"/v1/documents/{name}-doc", headers=key), 404, f"document not found: {name}-doc")
        assert_error(http.delete(f"/v1/documents/{name}-doc", headers=key), 404, f"document not found: {name}-doc")
        assert_error(http.post("/v1/query", headers=key, json={"question": "x?", "chunk_ids": [f"{name}/{name}-doc#0"]}),
                     404, f"unknown chunk id(s): {name}/{name}-doc#0")
    assert httpx.get(f"{http.base_url}/v1/documents/{other}-doc", headers=ADMIN,
                     params={"collection": other}).status_code == 200  # still there, untouched


def check_unscoped_defaults(http: httpx.Client, key: dict, own: str, model: str) -> None:
    """Without `collection`, a key works on its own collections: what it lists, sees and is cited."""
    for name in COLLECTIONS:  # a question aimed at every collection's text cites the key's own only
        asked = http.post("/v1/query", headers=key, json={"question": QUESTIONS[name], "top_k": 10})
        assert {s["collection"] for s in asked.json()["sources"]} == {own}
    listed = http.get("/v1/documents", headers=key).json()
    assert listed["collections"] == [own] and {d["collection"] for d in listed["documents"]} == {own}
    assert listed["total"] == 2
    assert [c["name"] for c in http.get("/v1/collections", headers=key).json()["collections"]] == [own]
    assert [m["id"] for m in http.get("/v1/models", headers=key).json()["data"]] == [model, f"{model}:{own}"]
    assert http.get("/v1/documents/same-id", headers=key).json()["collection"] == own
    for method, path, body in (("POST", "/v1/collections", {"name": "kbnew7f"}), ("GET", "/v1/keys", None),
                               ("POST", "/v1/keys", {"role": "read", "collections": [own]}),
                               ("DELETE", "/v1/keys/0123456789ab", None), ("GET", "/metrics", None)):
        assert_error(http.request(method, path, headers=key, json=body), 403,
                     "only the server's API key (server.api_key) may do this")


def test_the_server_key_sees_everything_and_metrics_name_no_collection(server):
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=120) as http:
        names = [c["name"] for c in http.get("/v1/collections").json()["collections"]]
        assert names == ["default", *sorted(COLLECTIONS)]
        both = http.post("/v1/query", json={"question": QUESTIONS["kbeng7f"], "collection": list(COLLECTIONS), "top_k": 10})
        assert {s["collection"] for s in both.json()["sources"]} == set(COLLECTIONS)
        assert http.post("/v1/query", json={"question": QUESTIONS["kbeng7f"]}).json()["sources"] == []  # default: empty
        text = http.get("/metrics").text
        for name in COLLECTIONS:
            assert name not in text and f"{name}-doc" not in text
        keys = http.get("/v1/keys").json()["keys"]
        assert len(keys) == 3 and all("key" not in k and "token_hash" not in k for k in keys)


def test_a_revoked_key_and_a_deleted_collection_stop_at_once(server):
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=120) as http:
        assert http.post("/v1/collections", json={"name": "kbtmp7f"}).status_code == 201
        ingest(http, "kbtmp7f", "Temporary notes about the migration window on Friday.")
        created = http.post("/v1/keys", json={"role": "admin", "collections": ["kbtmp7f"]}).json()
        key = {"Authorization": f"Bearer {created['key']}"}
        assert http.get("/v1/documents", headers=key).status_code == 200
        deleted = http.delete("/v1/collections/kbtmp7f", headers=key)  # its admin may delete it
        assert deleted.status_code == 200 and deleted.json()["num_documents"] == 2, deleted.text
        assert http.get("/v1/documents", headers=key).json()["documents"] == []  # nothing left to see
        assert http.post("/v1/collections", json={"name": "kbtmp7f"}).status_code == 201  # the name again...
        assert_error(http.get("/v1/documents", headers=key, params={"collection": "kbtmp7f"}), 404,
                     "collection not found: kbtmp7f")  # ...is not the old key's
        assert http.delete(f"/v1/keys/{created['id']}").json() == {"id": created["id"], "revoked": True}
        assert_error(http.get("/v1/collections", headers=key), 401,
                     "missing, wrong or revoked API key: send 'Authorization: Bearer <key>'")
        assert_error(http.delete("/v1/collections/default"), 409,
                     "the default collection cannot be deleted (documents sent without a collection land there); "
                     "delete its documents instead")
