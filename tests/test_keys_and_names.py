"""Keys that mean something on every server, and collection names checked once (issue 62), over real
HTTP (tiny random model, real MiniLM): on a server without a key of its own (`server.api_key`), a
token shaped like a scoped key that the server does not know, or that was revoked, is a 401 on every
route, never the server's; no scoped key can be made there (the 403 says how to set the server's key);
a live scoped key made before (an upgrade) closes the server to requests without a key. /readyz with a
key set leaves the document counts out. A collection named in the model field (`<model>:<collection>`)
is checked as the `collection` field's, with the same 422; no error echoes a name whole. A key whose
collections were all deleted gets a 404 saying so when it asks, not an answer from nothing."""

from __future__ import annotations

import time

import httpx
import pytest

from app.auth.tokens import new_token, token_hash
from app.testing import LiveServer
from configs.settings import load_settings
from retrieval.store_types import KeyRow

SERVER_KEY = "the-server-key"
ADMIN = {"Authorization": f"Bearer {SERVER_KEY}"}
BAD_KEY = "missing, wrong or revoked API key: send 'Authorization: Bearer <key>'"
MADE_UP = "rbk_0123456789ab_" + "A" * 43  # a well-formed token no server ever issued
# no relevance floor nor refusal of unmentioned names: what is checked is who reaches what, not relevance
RETRIEVAL = {"chunking": "none", "min_score": -1.0, "score_margin": 2.0, "refuse_unmentioned_names": False}


def start(tmp_path_factory, name: str, **server) -> LiveServer:
    settings = load_settings(data_dir=tmp_path_factory.mktemp(name), model={"name": "random:tiny-llama", "device": "cpu"},
                             generation={"max_tokens": 1}, retrieval=RETRIEVAL, server=server)
    return LiveServer(settings)


@pytest.fixture(scope="module")
def keyless(tmp_path_factory):
    with start(tmp_path_factory, "keyless") as live, httpx.Client(base_url=live.url, timeout=120) as http:
        assert http.post("/v1/collections", json={"name": "hr"}).status_code == 201
        ingest(http, "hr", "Every employee gets 31 days of annual leave.")
        yield live


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with start(tmp_path_factory, "keyed", api_key=SERVER_KEY) as live, \
            httpx.Client(base_url=live.url, headers=ADMIN, timeout=120) as http:
        assert http.post("/v1/collections", json={"name": "hr"}).status_code == 201
        ingest(http, "hr", "Every employee gets 31 days of annual leave.")
        yield live


def ingest(http: httpx.Client, collection: str, text: str) -> None:
    response = http.post("/v1/documents", json={"collection": collection, "documents": [{"id": "doc", "text": text}]})
    assert response.status_code == 201, response.text


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_error(response: httpx.Response, status: int, message: str | None = None) -> str:
    assert response.status_code == status, (response.request.method, response.request.url, response.text)
    text = response.json()["error"]["message"]
    assert message is None or text == message, text
    return text


def every_route(url: str) -> list[tuple[str, str]]:
    """(method, path) of every route of the schema that takes a key (path parameters filled in)."""
    schema = httpx.get(f"{url}/openapi.json", headers=ADMIN, timeout=30).json()
    return [(method.upper(), path.replace("{name}", "hr").replace("{key_id}", "0123456789ab")
             .replace("{document_id}", "doc").replace("{asset}", "swagger-ui-bundle.js"))
            for path, methods in schema["paths"].items() if path not in ("/healthz", "/readyz")
            for method in methods]


def assert_refused_everywhere(url: str, headers: dict[str, str]) -> None:
    routes = every_route(url)
    assert len(routes) >= 15 and ("POST", "/v1/keys") in routes and ("GET", "/metrics") in routes
    with httpx.Client(base_url=url, timeout=60) as http:
        for method, path in routes:
            assert_error(http.request(method, path, headers=headers), 401, BAD_KEY)


def test_a_keyless_server_refuses_unknown_and_revoked_scoped_keys_on_every_route(keyless):
    """Before: a made-up `rbk_` token, or a revoked key, was the server's own (200 on /v1/keys)."""
    assert_refused_everywhere(keyless.url, bearer(MADE_UP))
    assert_refused_everywhere(keyless.url, bearer("rbk_not-even-well-formed"))
    store = keyless.components.retriever.store
    key_id, token = new_token()
    store.create_key(KeyRow(key_id, "from before", token_hash(token), "read", ("hr",), time.time()))
    store.revoke_key(key_id, time.time())  # revoked: nothing live, so requests without a key stay the server's
    assert_refused_everywhere(keyless.url, bearer(token))
    with httpx.Client(base_url=keyless.url, timeout=60) as http:
        assert http.get("/v1/collections").status_code == 200  # no key at all: still the one user's server
        # an OpenAI client must send some key: one that is no scoped key's is no key
        assert http.get("/v1/keys", headers=bearer("unused-without-a-key")).status_code == 200


def test_a_keyless_server_makes_no_scoped_key_and_says_how_to_set_its_own(keyless):
    with httpx.Client(base_url=keyless.url, timeout=60) as http:
        before = http.get("/v1/keys").json()["keys"]
        text = assert_error(http.post("/v1/keys", json={"role": "read", "collections": ["hr"]}), 403)
        assert "RAGBLEND_SERVER__API_KEY" in text and "server.api_key" in text and "protect nothing" in text
        assert http.get("/v1/keys").json()["keys"] == before  # nothing was made


def test_a_live_key_from_before_closes_a_keyless_server_to_requests_without_a_key(keyless):
    """An upgrade: a scoped key made on this server before keys needed the server's own. It keeps its
    scope; a request without a key is a 401 saying how to set the server's key (it was everything)."""
    store = keyless.components.retriever.store
    key_id, token = new_token()
    store.create_key(KeyRow(key_id, "from before", token_hash(token), "read", ("hr",), time.time()))
    try:
        with httpx.Client(base_url=keyless.url, timeout=60) as http:
            for method, path in (("GET", "/v1/collections"), ("POST", "/v1/collections"), ("GET", "/v1/keys")):
                text = assert_error(http.request(method, path, json={"name": "new-kb"}), 401)
                assert "holds scoped API keys" in text and "RAGBLEND_SERVER__API_KEY" in text
            listed = http.get("/v1/collections", headers=bearer(token)).json()["collections"]
            assert [c["name"] for c in listed] == ["hr"]  # its own, as before
            assert_error(http.post("/v1/collections", headers=bearer(token), json={"name": "new-kb"}), 403)
            assert http.get("/v1/collections/new-kb").status_code == 401  # nor made by anyone else
    finally:
        store.revoke_key(key_id, time.time())
    with httpx.Client(base_url=keyless.url, timeout=60) as http:
        assert http.get("/v1/collections").status_code == 200  # none live: the one user's server again
        assert_error(http.get("/v1/collections", headers=bearer(token)), 401, BAD_KEY)


def test_a_keyed_server_refuses_unknown_and_revoked_keys_on_every_route(keyed):
    with httpx.Client(base_url=keyed.url, headers=ADMIN, timeout=60) as http:
        created = http.post("/v1/keys", json={"role": "admin", "collections": ["hr"]}).json()
        assert http.get("/v1/collections", headers=bearer(created["key"])).status_code == 200
        assert http.delete(f"/v1/keys/{created['id']}").status_code == 200
    assert_refused_everywhere(keyed.url, bearer(created["key"]))
    assert_refused_everywhere(keyed.url, bearer(MADE_UP))


def test_readyz_gives_no_counts_with_a_key_set_and_real_ones_without(keyed, keyless):
    """Before: with a key set, num_documents, num_chunks and num_indexed read 0, as an empty store's."""
    ready = httpx.get(f"{keyed.url}/readyz", timeout=30).json()
    assert ready == {"status": "ready", "model": keyed.components.model_id}
    counts = httpx.get(f"{keyless.url}/readyz", timeout=30).json()
    assert counts["status"] == "ready" and counts["num_documents"] >= 1 and counts["num_chunks"] >= 1
    assert counts["num_indexed"] == counts["num_chunks"] and "error" not in counts


def test_a_collection_in_the_model_name_is_checked_as_the_collection_field(keyless):
    """Before: `<model>:../x` was a 404 repeating the name (whole, or cut at a newline), `collection:
    "../x"` a 422 listing both branches of the union."""
    model = keyless.components.model_id
    message = [{"role": "user", "content": "How many days of annual leave?"}]
    with httpx.Client(base_url=keyless.url, timeout=60) as http:
        for name in ("../x", "hr\nx", "hr:x", "x" * 5000, "", "-x", "hr/x"):
            by_field = assert_error(http.post("/v1/query", json={"question": "q?", "collection": name}), 422)
            assert by_field.startswith("collection: not a collection name: ") and len(by_field) < 300
            assert "\n" not in by_field and by_field.count("x" * 64) <= 1
            reason = by_field.removeprefix("collection: ")
            assert_error(http.post("/v1/query", json={"question": "q?", "collection": ["hr", name]}), 422,
                         f"collection: {reason}")
            assert_error(http.post("/v1/chat/completions", json={"collection": name, "messages": message}), 422,
                         f"collection: {reason}")
            if name:  # `<model>:` alone names no collection: an unknown model
                assert_error(http.post("/v1/chat/completions", json={"model": f"{model}:{name}", "messages": message}),
                             422, f"model: {reason}")
                assert_error(http.post("/v1/completions", json={"model": f"{model}:{name}", "prompt": "q?"}), 422,
                             f"model: {reason}")
        # a valid name that is no collection: the same 404 both ways
        gone = "collection not found: nope"
        assert_error(http.post("/v1/query", json={"question": "q?", "collection": "nope"}), 404, gone)
        assert_error(http.post("/v1/chat/completions", json={"model": f"{model}:nope", "messages": message}), 404, gone)
        # another model: a 404 that echoes at most 64 of its characters, escaped
        unknown = assert_error(http.post("/v1/completions", json={"model": "m" * 5000 + "\nx", "prompt": "q?"}), 404)
        assert unknown.startswith("model not found: 'mmm") and "(5002 characters)" in unknown and len(unknown) < 300
        # a path parameter's name gets the same message
        assert_error(http.get("/v1/collections/-x"), 422, "path.name: not a collection name: '-x' (1 to 64 letters, "
                     "digits, '.', '_' or '-', the first a letter or a digit)")


def test_a_key_whose_collections_were_all_deleted_is_told_so_when_it_asks(keyed):
    """Before: a 200 with no sources, the not-found answer of a search over nothing."""
    with httpx.Client(base_url=keyed.url, headers=ADMIN, timeout=60) as http:
        assert http.post("/v1/collections", json={"name": "short-lived"}).status_code == 201
        ingest(http, "short-lived", "The pilot project ends in March.")
        key = bearer(http.post("/v1/keys", json={"role": "write", "collections": ["short-lived"]}).json()["key"])
        assert http.post("/v1/query", headers=key, json={"question": "When does the pilot end?"}).status_code == 200
        assert http.delete("/v1/collections/short-lived").status_code == 200
        none_left = ("this key's collections were all deleted: it has none left to work on (a collection made again "
                     "under a deleted one's name is not the key's)")
        question = [{"role": "user", "content": "When does the pilot end?"}]
        assert_error(http.post("/v1/query", headers=key, json={"question": "When does the pilot end?"}), 404, none_left)
        assert_error(http.post("/v1/chat/completions", headers=key, json={"messages": question}), 404, none_left)
        assert_error(http.post("/v1/completions", headers=key, json={"prompt": "When?"}), 404, none_left)
        # a write without `collection` too (was: "this key has 0 collections: name one with `collection`")
        assert_error(http.post("/v1/documents", headers=key, json={"documents": [{"text": "x"}]}), 404, none_left)
        # listings stay what they are: nothing to list
        assert http.get("/v1/documents", headers=key).json()["documents"] == []
        assert http.get("/v1/collections", headers=key).json() == {"collections": []}
