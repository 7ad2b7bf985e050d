"""Two real `ragblend serve` replicas on one Postgres (documents, change log) and one redis-server (KV),
an API key required, nginx (deploy/nginx.conf) in front: what one replica commits, the other lists,
retrieves and answers from, within a second, reusing the KV the first put in Redis; the same document
sent to both at once is one version, precomputed once; an answer streams through nginx unbuffered, its
rate limits (deploy/nginx.conf) notwithstanding; a collection created and a key revoked through one
replica hold on the other within a second. Redis requires a password, as in docker-compose.yml: the
replicas' redis_url carries it."""

from __future__ import annotations

import threading

import httpx
import psycopg
import pytest
import redis

try:
    from tests.nginx_server import NginxServer
    from tests.redis_server import start_or_skip as start_redis_or_skip
    from tests.replicas import (
        HEADERS, ask, fork_context, ingest, listed, metric, start_replicas, stop_all, until, write_config,
    )
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from nginx_server import NginxServer
    from redis_server import start_or_skip as start_redis_or_skip
    from replicas import (
        HEADERS, ask, fork_context, ingest, listed, metric, start_replicas, stop_all, until, write_config,
    )

MODEL_FROM_YAML = True  # its servers' model is the YAML config's (tests/conftest.py)

FOLLOW_S = 1.0  # the bound on change propagation between replicas
REDIS_PASSWORD = "replica-redis-secret"


@pytest.fixture(scope="module")
def cluster(postgres, tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    redis_server = start_redis_or_skip(root, password=REDIS_PASSWORD)
    database_url = postgres.new_database()
    try:
        config = write_config(root / "replica.yaml", redis_server.url, database_url)
        replicas = start_replicas(fork_context(), root, config)
        try:
            yield replicas[0].url, replicas[1].url, database_url, redis_server
        finally:
            stop_all(replicas)
    finally:
        redis_server.stop()


def _retrieves(url: str, question: str, doc_id: str) -> bool:
    return doc_id in {s["document_id"] for s in ask(url, question)["sources"]}


def test_a_document_ingested_through_a_is_answered_through_b_from_redis(cluster):
    a, b, _, _ = cluster
    ask(b, "warm up the question path")
    text = "The secret code of the blue vault is 4812. The vault stands in the old harbour of Porto."
    assert ingest(a, "vault", text)["status"] == "created"
    seconds = until(lambda: _retrieves(b, "What is the secret code of the blue vault?", "vault"), FOLLOW_S)
    assert seconds < FOLLOW_S and "vault" in listed(b)
    answer = ask(b, "What is the secret code of the blue vault?", mode="blend")
    assert answer["usage"]["reused_tokens"] > 0  # the passages' KV reused, not recomputed...
    assert metric(b, "ragblend_kv_hits_total", tier="redis") > 0  # ...loaded from the shared tier
    assert metric(b, "ragblend_kv_precomputes_total", outcome="computed") == 0  # B computed none of it


def test_redis_refuses_clients_without_the_password(cluster):
    """The KV hits above came through the replicas' redis_url, which carries the password."""
    *_, redis_server = cluster
    anonymous = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_connect_timeout=2)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    assert redis.Redis.from_url(redis_server.url).ping()


def test_a_replace_and_a_delete_through_b_are_followed_by_a(cluster):
    a, b, _, _ = cluster
    ingest(a, "ships", "Old ships sail from Lisbon at dawn. Their sails are red.")
    until(lambda: _retrieves(b, "When do the old ships sail?", "ships"), FOLLOW_S)
    assert ingest(b, "ships", "The violet zeppelin lands in Oslo every Tuesday.")["status"] == "replaced"

    def a_answers_the_new_version() -> bool:
        sources = ask(a, "Where does the violet zeppelin land?")["sources"]
        texts = [s["text"] for s in sources if s["document_id"] == "ships"]
        return bool(texts) and all("zeppelin" in t for t in texts)

    assert until(a_answers_the_new_version, FOLLOW_S) < FOLLOW_S
    chunks = httpx.get(f"{a}/v1/documents/ships", headers=HEADERS).json()["chunks"]
    assert "sail" not in " ".join(c["text"] for c in chunks)
    assert httpx.delete(f"{b}/v1/documents/ships", headers=HEADERS, timeout=60).status_code == 200
    assert until(lambda: "ships" not in listed(a), FOLLOW_S) < FOLLOW_S
    assert until(lambda: not _retrieves(a, "Where does the violet zeppelin land?", "ships"), FOLLOW_S) < FOLLOW_S
    assert httpx.get(f"{a}/v1/documents/ships", headers=HEADERS).status_code == 404


def test_a_delete_through_a_drops_the_prompts_b_keeps_with_its_chunks(cluster):
    """Each replica keeps its own prefix cache; B's index follower drops B's kept prompts holding a
    chunk of a document deleted through A (the same text sent again is not served from them)."""
    a, b, _, _ = cluster
    text = "The amber lighthouse of Vigo flashes twice every ten seconds from its granite tower."
    ingest(a, "amber", text)
    assert until(lambda: "amber" in listed(b), FOLLOW_S) < FOLLOW_S
    ids = [c["id"] for c in httpx.get(f"{b}/v1/documents/amber", headers=HEADERS).json()["chunks"]]
    question = "How does the amber lighthouse flash?"
    ask(b, question, chunk_ids=ids)
    kept = ask(b, question, chunk_ids=ids)["usage"]
    assert kept["prefix_cached_tokens"] == kept["prompt_tokens"]
    # A's cache is its own: B's kept prompt would cover it all; an earlier question on A shares at most
    # the template's head before the first chunk (system prompt, documents intro, the first label)
    assert ask(a, question, chunk_ids=ids)["usage"]["prefix_cached_tokens"] < kept["prompt_tokens"] // 2
    before = metric(b, "ragblend_prefix_cache_invalidations_total")
    assert httpx.delete(f"{a}/v1/documents/amber", headers=HEADERS, timeout=60).status_code == 200
    assert until(lambda: metric(b, "ragblend_prefix_cache_invalidations_total") > before, FOLLOW_S) < FOLLOW_S
    ingest(a, "amber", text)
    assert until(lambda: "amber" in listed(b), FOLLOW_S) < FOLLOW_S
    assert ask(b, question, chunk_ids=ids)["usage"]["prefix_cached_tokens"] < kept["prompt_tokens"]


def test_the_same_document_through_both_at_once_is_one_version_and_one_precompute(cluster):
    a, b, database_url, _ = cluster
    text = " ".join(f"Paragraph {i} of the twin report says the river rose {i} metres in spring." for i in range(12))
    before = {url: metric(url, "ragblend_kv_precomputes_total", reason="ingest", outcome="computed") for url in (a, b)}
    barrier, results = threading.Barrier(2), {}

    def send(url: str) -> None:
        barrier.wait()
        results[url] = ingest(url, "twin", text)

    threads = [threading.Thread(target=send, args=(url,)) for url in (a, b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert sorted(r["status"] for r in results.values()) == ["created", "unchanged"]
    num_chunks = len(results[a]["chunks"])
    assert num_chunks > 2 and results[a]["chunks"] == results[b]["chunks"]
    computed = sum(metric(url, "ragblend_kv_precomputes_total", reason="ingest", outcome="computed") - before[url]
                   for url in (a, b))
    assert computed == num_chunks  # each chunk's KV once, across both replicas
    with psycopg.connect(database_url) as conn:
        assert conn.execute("SELECT COUNT(*) FROM chunks WHERE document_id = 'twin'").fetchone()[0] == num_chunks
        assert conn.execute("SELECT COUNT(*) FROM changes WHERE document_id = 'twin'").fetchone()[0] == 1


@pytest.fixture(scope="module")
def nginx(cluster, tmp_path_factory):
    from app.testing import free_port

    a, b, _, _ = cluster
    try:
        server = NginxServer([u.removeprefix("http://") for u in (a, b)], free_port(), tmp_path_factory.mktemp("nginx"))
    except FileNotFoundError as exc:
        pytest.skip(f"no nginx to put in front: {exc}")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def test_nginx_in_front_requires_the_key_and_streams_an_answer_unbuffered(cluster, nginx):
    a, b, _, _ = cluster
    assert httpx.get(f"{nginx}/v1/documents", timeout=30).status_code == 401
    text = "The lighthouse of Kalmar flashes green twice every nine seconds."
    assert ingest(nginx, "lighthouse", text)["status"] in ("created", "unchanged")
    question = "How does the lighthouse of Kalmar flash?"
    for url in (a, b):  # whichever replica nginx picks next knows it
        until(lambda: _retrieves(url, question, "lighthouse"), FOLLOW_S)
    reads = []
    body = {"question": question, "top_k": 2, "max_tokens": 24, "stream": True}
    with httpx.stream("POST", f"{nginx}/v1/query", json=body, headers=HEADERS, timeout=120) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        reads = [chunk.decode() for chunk in response.iter_raw() if chunk]
    stream = "".join(reads)
    assert '"document_id":"lighthouse"' in stream and "event: done" in stream
    # Unbuffered: the sources event came through on its own, before the answer was complete.
    assert len(reads) > 1 and "sources" in reads[0] and "event: done" not in reads[0]


def test_a_collection_and_a_key_made_or_revoked_through_a_hold_on_b_within_a_second(cluster):
    a, b, _, _ = cluster
    assert httpx.post(f"{a}/v1/collections", headers=HEADERS, json={"name": "repl-kb"}).status_code == 201
    response = httpx.post(f"{a}/v1/documents", headers=HEADERS, timeout=120, json={
        "collection": "repl-kb", "documents": [{"id": "tide", "text": "High tide at Saint-Malo reaches twelve metres."}]})
    assert response.status_code == 201, response.text
    created = httpx.post(f"{a}/v1/keys", headers=HEADERS, json={"role": "read", "collections": ["repl-kb"]}).json()
    key = {"Authorization": f"Bearer {created['key']}"}

    def b_answers_with_the_key() -> bool:
        answer = httpx.post(f"{b}/v1/query", headers=key, timeout=60,
                            json={"question": "How high is the tide at Saint-Malo?", "max_tokens": 1})
        return answer.status_code == 200 and [s["document_id"] for s in answer.json()["sources"]] == ["tide"]

    assert until(b_answers_with_the_key, FOLLOW_S) < FOLLOW_S  # the key, the collection and its index on B
    names = [c["name"] for c in httpx.get(f"{b}/v1/collections", headers=key).json()["collections"]]
    assert names == ["repl-kb"]
    assert httpx.delete(f"{a}/v1/keys/{created['id']}", headers=HEADERS).status_code == 200
    assert until(lambda: httpx.get(f"{b}/v1/documents", headers=key).status_code == 401, FOLLOW_S) < FOLLOW_S
    assert httpx.delete(f"{a}/v1/collections/repl-kb", headers=HEADERS, timeout=60).status_code == 200

    def b_has_no_such_collection() -> bool:
        answer = httpx.post(f"{b}/v1/query", headers=HEADERS, timeout=60,
                            json={"question": "tide?", "collection": "repl-kb", "max_tokens": 1})
        return answer.status_code == 404

    assert until(b_has_no_such_collection, FOLLOW_S) < FOLLOW_S
