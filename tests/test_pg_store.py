"""The Postgres document store's own contract (the common one runs against both stores in
test_retrieval.py): the versioned schema, the change log replicas follow, and a clear error while the
server is down. A real temporary cluster (tests/postgres_server.py)."""

from __future__ import annotations

import time

import numpy as np
import psycopg
import pytest

from configs.enums import IndexKind
from retrieval.config import RetrievalConfig
from retrieval.pg_store import SCHEMA_VERSION, PostgresDocumentStore
from retrieval.retriever import Retriever
from retrieval.store_types import NewChunk, StoreUnavailableError


def _put(retriever: Retriever, doc_id: str, texts: list[str]):
    vectors = retriever.embedder.encode(texts)
    chunks = [NewChunk(t, (i + 1,), v) for i, (t, v) in enumerate(zip(texts, vectors))]
    return retriever.store.put_document(doc_id, None, {}, sum(map(len, texts)), chunks)


def test_schema_is_created_once_versioned_and_a_newer_one_refused(postgres):
    url = postgres.new_database()
    PostgresDocumentStore(url).close()
    PostgresDocumentStore(url).close()  # a second start finds it: nothing to do
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT version FROM ragblend_schema").fetchall() == [(SCHEMA_VERSION,)]
        conn.execute("UPDATE ragblend_schema SET version = %s", (SCHEMA_VERSION + 1,))
    with pytest.raises(RuntimeError, match="newer ragblend"):
        PostgresDocumentStore(url)


def test_a_read_opens_no_transaction_and_a_write_of_several_statements_is_still_one_transaction(postgres):
    """The pool's connections are in autocommit: a read leaves no transaction open for the pool to commit
    (BEGIN and COMMIT: two more round trips a call), and a document's rows, written in an explicit transaction, appear
    together or not at all."""
    store = PostgresDocumentStore(postgres.new_database())
    try:
        with store._connection() as conn:
            conn.execute("SELECT 1").fetchall()
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        vector = np.ones(4, dtype=np.float32) / 2
        with pytest.raises(psycopg.errors.NotNullViolation):  # the second chunk's row fails: nothing stays
            store.put_document("doc", None, {}, 10, [NewChunk("first", (1,), vector), NewChunk(None, (2,), vector)])
        assert store.num_documents() == 0 and store.num_chunks() == 0
    finally:
        store.close()


@pytest.mark.parametrize("kind", list(IndexKind))
def test_a_replica_index_follows_the_other_replicas_commits(postgres, tmp_path, kind):
    """Two retrievers (two replicas' indexes) on one database: each catches up with the other's
    creates, replaces and deletes through the change log, and its own writes are not applied twice."""
    url, settings = postgres.new_database(), RetrievalConfig(index=kind)
    a = Retriever.open(tmp_path / "a", settings, PostgresDocumentStore(url))
    b = Retriever.open(tmp_path / "b", settings, PostgresDocumentStore(url))
    try:
        first = _put(a, "ships", ["Old ships sail at dawn.", "Old harbours smell of tar."])
        a.follow([], first.document.chunks, a.embedder.encode(["x", "y"]))
        assert b.search("When do old ships sail?", 1, ["default"]) == []
        caught = b.catch_up()
        assert caught.num_added == 2 and caught.seq == a.store.change_seq()
        assert b.search("When do old ships sail?", 1, ["default"])[0].chunk.document_id == "ships"
        replaced = _put(b, "ships", ["The violet zeppelin lands in Oslo."])
        b.follow(replaced.replaced, replaced.document.chunks, b.embedder.encode(["z"]))
        a.catch_up()
        assert set(a.index.ids().tolist()) == a.store.row_ids() == set(b.index.ids().tolist())
        assert a.search("Where does the violet zeppelin land?", 1, ["default"])[0].chunk.text.startswith("The violet")
        assert b.catch_up().num_added == 0  # its own write, already followed
        b.follow(b.store.delete_document("ships"), [], [])
        assert a.catch_up().num_removed == 1 and a.index.num_vectors == 0
    finally:
        a.close()
        b.close()


def test_a_replica_behind_a_pruned_log_reconciles_by_id_sets(postgres, tmp_path):
    url = postgres.new_database()
    a = Retriever.open(tmp_path / "a", RetrievalConfig(), PostgresDocumentStore(url))
    try:
        _put(a, "one", ["Alpha one."])
        _put(a, "two", ["Beta two."])
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DELETE FROM changes WHERE seq = 1")  # pruned before this replica read it
        caught = a.catch_up()
        assert caught.is_reconciled and set(a.index.ids().tolist()) == a.store.row_ids()
    finally:
        a.close()


def test_a_stopped_server_is_a_clear_unavailable_error_and_a_restart_heals(postgres, tmp_path):
    url = postgres.new_database()
    store = PostgresDocumentStore(url, timeout_s=1.0)
    try:
        vector = np.ones(4, dtype=np.float32) / 2
        store.put_document("a", None, {}, 1, [NewChunk("x", (1,), vector)])
        postgres.stop()
        try:
            with pytest.raises(StoreUnavailableError, match="document store"):
                store.put_document("b", None, {}, 1, [NewChunk("y", (1,), vector)])
            with pytest.raises(StoreUnavailableError):
                store.list_documents()
        finally:
            postgres.start()
        # healed within seconds: the pool reconnects in the background, backing off while the server
        # was down, so on a loaded machine the first call may still be the clear error (retry later)
        deadline = time.monotonic() + 15
        while True:
            try:
                store.put_document("b", None, {}, 1, [NewChunk("y", (1,), vector)])
                break
            except StoreUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert [d.id for d in store.list_documents()] == ["a", "b"]
    finally:
        store.close()


def test_an_unreachable_database_at_start_is_a_clear_error():
    with pytest.raises(StoreUnavailableError, match="cannot connect"):
        PostgresDocumentStore("postgresql://nobody@127.0.0.1:1/none", timeout_s=1.0)


def test_store_copy_moves_a_sqlite_install_into_postgres_and_is_safe_to_rerun(postgres, tmp_path, capsys):
    """`ragblend store copy`: documents, chunks, token ids, KV keys, embeddings and content hashes
    arrive whole; a re-run is a no-op; a document that differs in Postgres is kept unless --overwrite;
    a replica opening the Postgres store builds its index from what was copied."""
    from app import cli
    from retrieval.doc_store import SqliteDocumentStore

    data_dir, url = tmp_path / "old", postgres.new_database()
    old = Retriever.open(data_dir, RetrievalConfig())
    texts = {"vault": ["The secret code of the blue vault is 4812."],
             "bridge": ["The red bridge in Lisbon was painted in 1966.", "Forty workers painted it."]}
    for doc_id, chunk_texts in texts.items():
        vectors = old.embedder.encode(chunk_texts)
        chunks = [NewChunk(t, (i + 1, 7), v, f"key-{doc_id}-{i}") for i, (t, v) in enumerate(zip(chunk_texts, vectors))]
        old.store.put_document(doc_id, doc_id.title(), {"from": "sqlite"}, 40, chunks, content_hash=f"hash-{doc_id}")
    old.close()
    argv = ["store", "copy", "--data-dir", str(data_dir), "--database-url", url]
    assert cli.main(argv) == 0
    assert "copied 2 documents (3 chunks)" in capsys.readouterr().out
    source, target = SqliteDocumentStore(data_dir / "documents.sqlite3"), PostgresDocumentStore(url)
    try:
        for want, got in zip(source.export_documents(), target.export_documents()):
            assert (got.document.id, got.document.title, got.document.metadata, got.content_hash) == (
                want.document.id, want.document.title, want.document.metadata, want.content_hash)
            assert [(c.text, c.token_ids, c.kv_key) for c in got.chunks] == [
                (c.text, c.token_ids, c.kv_key) for c in want.chunks]
            assert all(np.array_equal(g.embedding, w.embedding) for g, w in zip(got.chunks, want.chunks))
        assert cli.main(argv) == 0 and "unchanged 2" in capsys.readouterr().out
        target.put_document("vault", None, {}, 3, [NewChunk("other", (1,), np.ones(384, np.float32))], "hash-new")
        assert cli.main(argv) == 1 and "kept (differs; --overwrite replaces it): vault" in capsys.readouterr().out
        assert cli.main(argv + ["--overwrite"]) == 0 and "replaced 1" in capsys.readouterr().out
    finally:
        source.close()
        target.close()
    replica = Retriever.open(tmp_path / "replica", RetrievalConfig(), PostgresDocumentStore(url))
    try:
        assert replica.search("What is the code of the blue vault?", 1, ["default"])[0].chunk.kv_key == "key-vault-0"
    finally:
        replica.close()
    assert cli.main(["store", "copy", "--data-dir", str(tmp_path / "none"), "--database-url", url]) == 2
