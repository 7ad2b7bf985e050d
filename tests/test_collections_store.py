"""Collections and API keys in the document store, on SQLite and on a real Postgres (every test runs
against both): documents keyed by (collection, id), a collection's deletion in one transaction with its
documents, chunks and key grants, keys stored by hash; and the in-place migration of a store made
before collections (today's schema, written here as it was) into the `default` collection, with its
row ids, chunk ids, KV keys and vector index kept."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import psycopg
import pytest

from configs.enums import IndexKind
from retrieval.config import RetrievalConfig
from retrieval.doc_store import SCHEMA_VERSION as SQLITE_VERSION, SqliteDocumentStore
from retrieval.index import VectorIndex
from retrieval.pg_store import _MIGRATIONS as PG_MIGRATIONS, SCHEMA_VERSION as PG_VERSION, PostgresDocumentStore
from retrieval.retriever import Retriever
from retrieval.store_types import (
    DEFAULT_COLLECTION, ChunkTokens, CollectionExistsError, CollectionNotFoundError, CollectionRow, DocumentStore,
    KeyRow, NewChunk,
)


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path):
    if request.param == "sqlite":
        opened: DocumentStore = SqliteDocumentStore(tmp_path / "documents.sqlite3")
    else:
        opened = PostgresDocumentStore(request.getfixturevalue("postgres").new_database())
    yield opened
    opened.close()


def _chunk(text: str, key: str | None = None, dim: int = 4) -> NewChunk:
    return NewChunk(text, (1, 2, 3), np.full(dim, 0.5, dtype=np.float32), key)


def _collection(name: str, salt: str = "s", budget: int | None = None) -> CollectionRow:
    return CollectionRow(name, f"about {name}", 1.0, salt, False, budget)


def test_the_same_document_id_in_two_collections_is_two_documents(store):
    store.create_collection(_collection("hr"))
    store.put_document("policy", "HR", {}, 3, [_chunk("leave", "k-hr")], collection="hr")
    store.put_document("policy", "Default", {}, 3, [_chunk("deploys", "k-default")])
    hr, default = store.get_document("policy", "hr"), store.get_document("policy")
    assert (hr.title, hr.collection, [c.id for c in hr.chunks]) == ("HR", "hr", ["hr/policy#0"])
    assert (default.title, default.collection, [c.id for c in default.chunks]) == ("Default", "default", ["policy#0"])
    assert [r.id for r in store.list_documents(collections=["hr"])] == ["policy"]
    assert {r.collection for r in store.list_documents(collections=["hr", DEFAULT_COLLECTION])} == {"hr", "default"}
    assert store.collections_of_document("policy", ["hr", "default", "other"]) == ["default", "hr"]
    assert store.num_documents(["hr"]) == 1 and store.num_documents() == 2 and store.num_chunks(["hr"]) == 1
    assert set(store.chunks_by_ids(["hr/policy#0", "policy#0"], ["hr"])) == {"hr/policy#0"}
    assert store.kv_keys(["hr"]) == {"k-hr"} and store.collection_of_kv_key("k-hr") == "hr"
    assert store.delete_document("policy", "hr") is not None and store.get_document("policy") is not None
    with pytest.raises(CollectionNotFoundError):
        store.put_document("x", None, {}, 1, [_chunk("x")], collection="nope")


def test_chunks_are_paged_by_row_id_and_retokenized_in_one_write(store):
    """iter_chunks: every chunk once, by row id, across collections and pages; set_chunk_tokens: new token
    ids and KV keys for chunks by id (what a rebuild for another model writes), nothing else changed;
    set_chunk_embeddings: new vectors by row id (another embedder's), the others kept."""
    store.create_collection(_collection("hr"))
    store.put_document("a", None, {}, 9, [_chunk("one", "k1"), _chunk("two", "k2"), _chunk("three", "k3")])
    store.put_document("b", None, {}, 4, [_chunk("four", "k4")], collection="hr")
    pages = list(store.iter_chunks(batch_size=2))
    assert [len(p) for p in pages] == [2, 2]
    chunks = [c for p in pages for c in p]
    assert [c.text for c in chunks] == ["one", "two", "three", "four"] and chunks[3].collection == "hr"
    assert [c.row_id for c in chunks] == sorted(c.row_id for c in chunks)
    store.set_chunk_tokens([ChunkTokens("a#1", (7, 8), "k2-new"), ChunkTokens("hr/b#0", (9,), "k4-new")])
    after = {c.id: c for p in store.iter_chunks() for c in p}
    assert (after["a#1"].token_ids, after["a#1"].kv_key, after["a#1"].text) == ((7, 8), "k2-new", "two")
    assert (after["hr/b#0"].token_ids, after["hr/b#0"].kv_key) == ((9,), "k4-new")
    assert (after["a#0"].token_ids, after["a#0"].kv_key) == ((1, 2, 3), "k1")
    assert store.kv_keys() == {"k1", "k2-new", "k3", "k4-new"} and store.num_chunk_tokens() == 3 + 2 + 3 + 1
    row_ids = [after["a#0"].row_id, after["hr/b#0"].row_id]
    store.set_chunk_embeddings(row_ids, np.array([[1, 0], [0, 1]], dtype=np.float32))  # another embedder's
    assert [store.embeddings_of([i]).vectors.tolist() for i in row_ids] == [[[1.0, 0.0]], [[0.0, 1.0]]]
    assert store.embeddings_of([after["a#1"].row_id]).vectors.tolist() == [[0.5] * 4]


def test_a_collection_goes_whole_with_its_documents_chunks_and_key_grants(store):
    store.create_collection(_collection("eng", budget=1000))
    with pytest.raises(CollectionExistsError):
        store.create_collection(_collection("eng"))
    store.put_document("a", None, {}, 1, [_chunk("one"), _chunk("two")], collection="eng")
    store.put_document("b", None, {}, 1, [_chunk("three")], collection="eng")
    store.put_document("c", None, {}, 1, [_chunk("kept")])
    store.create_key(KeyRow("0123456789ab", "ci", "hash", "write", ("default", "eng"), 2.0))
    counts = store.collection_counts(["eng", "default", "none"])
    assert (counts["eng"].num_documents, counts["eng"].num_chunks, counts["eng"].num_tokens) == (2, 3, 9)
    assert counts["none"].num_documents == 0
    live = store.row_ids()
    deleted = store.delete_collection("eng")
    assert len(deleted) == 3 and {c.collection for c in deleted} == {"eng"}
    assert store.row_ids() == live - {c.row_id for c in deleted}
    assert store.get_collection("eng") is None and store.delete_collection("eng") is None
    assert store.get_key("0123456789ab").collections == ("default",)  # its grant went with the collection
    store.create_collection(_collection("eng"))  # a new collection of the same name: the old grant does not return
    assert store.get_key("0123456789ab").collections == ("default",)
    assert store.list_documents(collections=["eng"]) == [] and store.get_document("c") is not None


def test_collections_update_and_keys_are_stored_by_hash_and_revoked_once(store):
    store.create_collection(_collection("hr", salt="salt-1"))
    assert store.update_collection(CollectionRow("hr", "new words", 9.0, "other-salt", True, 500))
    row = store.get_collection("hr")
    assert (row.description, row.kv_budget_bytes, row.kv_salt, row.shares_kv) == ("new words", 500, "salt-1", False)
    assert [c.name for c in store.list_collections()] == ["default", "hr"]
    with pytest.raises(CollectionNotFoundError):
        store.create_key(KeyRow("aaaaaaaaaaaa", "", "h", "read", ("missing",), 1.0))
    assert store.get_key("aaaaaaaaaaaa") is None and not store.has_live_keys()  # nothing written
    store.create_key(KeyRow("aaaaaaaaaaaa", "reader", "h1", "read", ("hr",), 1.0))
    assert store.has_live_keys()
    with pytest.raises(CollectionExistsError):
        store.create_key(KeyRow("aaaaaaaaaaaa", "again", "h2", "read", ("hr",), 1.0))
    assert store.revoke_key("aaaaaaaaaaaa", 5.0) and not store.revoke_key("aaaaaaaaaaaa", 6.0)
    assert not store.has_live_keys()  # a revoked key is no live one (app/deps.py: get_principal)
    assert not store.revoke_key("bbbbbbbbbbbb", 6.0)
    [key] = store.list_keys()
    assert (key.token_hash, key.collections, key.revoked_at) == ("h1", ("hr",), 5.0)


# --- migration of a store made before collections ----------------------------------------------------

# SQLite's schema as the code before collections created it (retrieval/doc_store.py, schema 1, no version).
_SQLITE_BEFORE = """
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY, title TEXT, metadata TEXT NOT NULL, num_chars INTEGER NOT NULL,
    created_at REAL NOT NULL, content_hash TEXT);
CREATE TABLE IF NOT EXISTS chunks (
    row_id INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
    document_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE, position INTEGER NOT NULL,
    text TEXT NOT NULL, token_ids TEXT NOT NULL, kv_key TEXT, embedding BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks(document_id, position);
"""
DIM = 384  # MiniLM's: the retriever below opens the migrated store


def _vector(seed: int) -> np.ndarray:
    vector = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
    return vector / np.linalg.norm(vector)


OLD_DOCS = {"vault": ["The secret code of the blue vault is 4812."],
            "bridge": ["The red bridge in Lisbon was painted in 1966.", "Forty workers painted it."],
            "gone": ["A document deleted before the upgrade."]}


def _fill_old(execute) -> dict[str, list[int]]:
    """Write OLD_DOCS through the old schema (`execute(sql, params)` returns the new row id), then delete
    `gone`: the highest row id is dead, so the AUTOINCREMENT high-water mark is above every live id."""
    row_ids: dict[str, list[int]] = {}
    for n, (doc_id, texts) in enumerate(OLD_DOCS.items()):
        execute("INSERT INTO documents (id, title, metadata, num_chars, created_at, content_hash)"
                " VALUES (%s, %s, %s, %s, %s, %s)", (doc_id, doc_id.title(), json.dumps({"n": n}), 10, 1.0 + n, f"h-{doc_id}"))
        for position, text in enumerate(texts):
            row_ids.setdefault(doc_id, []).append(execute(
                "INSERT INTO chunks (id, document_id, position, text, token_ids, kv_key, embedding)"
                " VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING row_id",
                (f"{doc_id}#{position}", doc_id, position, text, [7, position], f"kv-{doc_id}-{position}",
                 _vector(len(row_ids) * 10 + position).tobytes())))
    execute("DELETE FROM documents WHERE id = %s", ("gone",))
    return row_ids


def _check_migrated(store: DocumentStore, row_ids: dict[str, list[int]]) -> None:
    assert [c.name for c in store.list_collections()] == [DEFAULT_COLLECTION]
    assert store.get_collection(DEFAULT_COLLECTION).kv_salt == ""  # unsalted: the stored KV keys stay valid
    assert [(r.id, r.collection) for r in store.list_documents()] == [("vault", "default"), ("bridge", "default")]
    bridge = store.get_document("bridge")
    assert (bridge.title, bridge.metadata, store.content_hash("bridge")) == ("Bridge", {"n": 1}, "h-bridge")
    assert [(c.id, c.row_id, c.kv_key, c.token_ids) for c in bridge.chunks] == [
        ("bridge#0", row_ids["bridge"][0], "kv-bridge-0", (7, 0)), ("bridge#1", row_ids["bridge"][1], "kv-bridge-1", (7, 1))]
    assert store.row_ids() == set(row_ids["vault"] + row_ids["bridge"])
    new = store.put_document("new", None, {}, 1, [NewChunk("after", (1,), _vector(99), None)])
    assert new.document.chunks[0].row_id > max(row_ids["gone"])  # the dead id is never reused
    assert store.delete_document("vault") is not None and store.get_document("vault") is None  # cascades still hold
    assert store.chunks_by_ids(["vault#0"]) == {}


def test_a_sqlite_store_made_before_collections_is_migrated_in_place(tmp_path):
    path = tmp_path / "documents.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA foreign_keys = ON")
    conn.executescript(_SQLITE_BEFORE)

    def execute(sql: str, params: tuple) -> int | None:
        params = tuple(json.dumps(p) if isinstance(p, list) else p for p in params)
        row = conn.execute(sql.replace("%s", "?"), params).fetchone()
        return None if row is None else row[0]

    row_ids = _fill_old(execute)
    conn.close()
    legacy = VectorIndex(DIM, IndexKind.FLAT, path=tmp_path / "index.faiss")  # the old single index
    legacy.add(np.array(row_ids["vault"] + row_ids["bridge"]), np.stack([_vector(0), _vector(10), _vector(11)]))
    legacy.save()
    store = SqliteDocumentStore(path)
    try:
        _check_migrated(store, row_ids)
    finally:
        store.close()
    with sqlite3.connect(path) as check:
        assert check.execute("PRAGMA user_version").fetchone()[0] == SQLITE_VERSION == 3  # 3: the lexical index
        assert not check.execute("PRAGMA foreign_key_check").fetchall()
    SqliteDocumentStore(path).close()  # a second open: nothing left to do
    with sqlite3.connect(path) as check:  # a newer version is refused, naming it
        check.execute(f"PRAGMA user_version = {SQLITE_VERSION + 1}")
    with pytest.raises(RuntimeError, match="newer ragblend"):
        SqliteDocumentStore(path)
    with sqlite3.connect(path) as check:
        check.execute(f"PRAGMA user_version = {SQLITE_VERSION}")
    retriever = Retriever.open(tmp_path, RetrievalConfig())  # the old index.faiss becomes default's, unrebuilt
    try:
        assert not (tmp_path / "index.faiss").exists() and (tmp_path / "index" / "default.faiss").is_file()
        assert retriever.index.collections == ["default"]
        assert set(retriever.index.ids().tolist()) == retriever.store.row_ids()
        assert retriever.search("bridge", 1, ["default"])
    finally:
        retriever.close()


def test_a_postgres_store_made_before_collections_is_migrated_in_place(postgres):
    url = postgres.new_database()
    with psycopg.connect(url, autocommit=True) as conn:  # the schema as the code before collections made it
        conn.execute("CREATE TABLE ragblend_schema (version INTEGER NOT NULL)")
        conn.execute(PG_MIGRATIONS[1])
        conn.execute("INSERT INTO ragblend_schema (version) VALUES (1)")

        def execute(sql: str, params: tuple) -> int | None:
            cursor = conn.execute(sql, params)
            return cursor.fetchone()[0] if "RETURNING" in sql else None

        row_ids = _fill_old(execute)
    store = PostgresDocumentStore(url)
    try:
        _check_migrated(store, row_ids)
    finally:
        store.close()
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT version FROM ragblend_schema").fetchall() == [(PG_VERSION,)] and PG_VERSION == 3
    PostgresDocumentStore(url).close()
