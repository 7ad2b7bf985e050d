"""Faults of the replicated topology, with real processes: replica A SIGKILLed in the middle of ingests
(B lists only whole documents; A restarts, catches up, and keeps no orphan KV), and Postgres stopped
and restarted under load (a clear 503 while it is down, success after, no acknowledged write lost)."""

from __future__ import annotations

import random
import threading
import time

import faiss
import httpx
import psycopg
import pytest

try:
    from tests.crash_harness import _sentence
    from tests.redis_server import start_or_skip as start_redis_or_skip
    from tests.replicas import (
        HEADERS, ask, fork_context, ingest, listed, restart, start_replicas, stop_all, until, write_config,
    )
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from crash_harness import _sentence
    from redis_server import start_or_skip as start_redis_or_skip
    from replicas import (
        HEADERS, ask, fork_context, ingest, listed, restart, start_replicas, stop_all, until, write_config,
    )

from kv_store.disk import SUFFIX

MODEL_FROM_YAML = True  # its servers' model is the YAML config's (tests/conftest.py)

FAULTS_CONFIG_EXTRA = """\
  disk_enabled: true                # each replica's own disk tier too: orphans there must be collected
  write_tiers: [disk, redis]
"""


@pytest.fixture(scope="module")
def cluster(postgres, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    redis_server = start_redis_or_skip(root)
    database_url = postgres.new_database()
    ctx = fork_context()
    try:
        config = write_config(root / "replica.yaml", redis_server.url, database_url, poll_s=1.0)
        text = config.read_text().replace("  disk_enabled: false\n  write_tiers: [redis]"
                                          "             # KV lives in the shared tier only: a hit on B is A's entry\n",
                                          FAULTS_CONFIG_EXTRA)
        assert "disk_enabled: true" in text
        config.write_text(text)
        replicas = start_replicas(ctx, root, config)
        try:
            yield ctx, config, replicas, database_url, postgres
        finally:
            stop_all(replicas)
    finally:
        redis_server.stop()


def _document_text(rng: random.Random) -> str:
    return " ".join(_sentence(rng) for _ in range(rng.randint(2, 6)))


def test_kill_9_of_a_during_ingests_leaves_whole_documents_and_a_catches_up(cluster):
    ctx, config, (a, b), database_url, _ = cluster
    rng, sent, acked, errors = random.Random(7), {}, set(), []

    def workload() -> None:
        with httpx.Client(base_url=a.url, headers=HEADERS, timeout=60) as http:
            for n in range(10_000):
                batch = [{"id": f"doc{n}-{i}", "text": _document_text(rng)} for i in range(rng.randint(1, 3))]
                sent.update({d["id"]: d["text"] for d in batch})
                try:
                    response = http.post("/v1/documents", json={"documents": batch})
                except httpx.TransportError:
                    return  # killed mid-request
                if response.status_code != 201:
                    errors.append(f"{response.status_code}: {response.text[:200]}")
                    return
                acked.update(d["id"] for d in batch)

    thread = threading.Thread(target=workload, daemon=True)
    thread.start()
    until(lambda: len(acked) >= 4, 120, poll_s=0.05)
    time.sleep(rng.uniform(0.05, 0.5))  # somewhere inside the next batch
    a.server.kill()
    thread.join(30)
    assert not errors

    on_b = listed(b.url)
    assert acked <= on_b <= set(sent)  # every acknowledged document, nothing that was never sent
    with psycopg.connect(database_url) as conn:
        for doc_id in on_b:  # each one whole: its text exactly, in as many chunks as it has rows
            doc = httpx.get(f"{b.url}/v1/documents/{doc_id}", headers=HEADERS, timeout=30).json()
            assert "".join("".join(c["text"].split()) for c in doc["chunks"]) == "".join(sent[doc_id].split())
            rows = conn.execute("SELECT COUNT(*) FROM chunks WHERE document_id = %s", (doc_id,)).fetchone()[0]
            assert rows == len(doc["chunks"]) > 0

    late = ingest(b.url, "written-while-a-was-down", "The amber tram to Gdansk leaves at noon on Sundays.")
    assert late["status"] == "created"
    restart(ctx, a, config)
    assert listed(a.url) == listed(b.url)
    assert until(lambda: "written-while-a-was-down" in {
        s["document_id"] for s in ask(a.url, "When does the amber tram to Gdansk leave?")["sources"]}, 1.0) < 1.0
    with psycopg.connect(database_url) as conn:
        row_ids = {r[0] for r in conn.execute("SELECT row_id FROM chunks")}
        live_keys = {r[0] for r in conn.execute("SELECT kv_key FROM chunks WHERE kv_key IS NOT NULL")}
    index = faiss.read_index(str(a.data_dir / "index" / "default.faiss"))  # saved by the start-up reconcile
    assert set(faiss.vector_to_array(index.id_map).tolist()) == row_ids
    on_disk = {p.name[: -len(SUFFIX)] for p in (a.data_dir / "kv").glob("??/*" + SUFFIX)}
    assert on_disk and on_disk <= live_keys  # the killed batch's entries were collected at start-up


def test_postgres_restarted_under_load_is_a_clear_503_and_nothing_is_lost(cluster):
    _, _, (a, b), _, postgres = cluster
    acked, statuses, bodies, stop = set(), [], [], threading.Event()

    def load(url: str, prefix: str) -> None:
        with httpx.Client(base_url=url, headers=HEADERS, timeout=60) as http:
            n = 0
            while not stop.is_set():
                doc_id = f"{prefix}{n}"
                n += 1
                try:
                    response = http.post("/v1/documents", json={"documents": [
                        {"id": doc_id, "text": f"Load document {doc_id} counts {n} red herons."}]})
                    statuses.append(response.status_code)
                    if response.status_code == 201:
                        acked.add(doc_id)
                    else:
                        bodies.append(response)
                    response = http.post("/v1/query", json={"question": "How many red herons?", "max_tokens": 1})
                    statuses.append(response.status_code)
                    if response.status_code != 200:
                        bodies.append(response)
                except httpx.TransportError as exc:
                    bodies.append(exc)
                time.sleep(0.05)

    threads = [threading.Thread(target=load, args=(r.url, f"load-{r.name}-"), daemon=True) for r in (a, b)]
    for thread in threads:
        thread.start()
    try:
        until(lambda: len(acked) >= 4, 60, poll_s=0.05)
        postgres.stop()
        try:
            until(lambda: any(getattr(r, "status_code", 0) == 503 for r in bodies), 30, poll_s=0.05)
        finally:
            postgres.start()
        num_acked_at_restart = len(acked)
        until(lambda: len(acked) >= num_acked_at_restart + 4, 60, poll_s=0.05)  # both replicas write again
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    failures = [r for r in bodies if isinstance(r, Exception) or r.status_code != 503]
    assert not failures, [getattr(r, "text", repr(r))[:300] for r in failures]
    for response in bodies:  # every failure a clear, retryable 503
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "document store" in error["message"]
        assert response.headers["Retry-After"]
    for replica in (a, b):
        assert acked <= listed(replica.url)  # no acknowledged write lost
