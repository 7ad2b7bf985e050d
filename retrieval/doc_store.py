"""SQLite document store (the embedded default, one process): documents and their chunks (text,
token ids, KV key, embedding). The interface and row types: retrieval/store_types.py."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from retrieval.lexical import fts5_query, query_terms
from retrieval.store_types import (
    Changes, DocumentStore, DocumentSummaryRow, ExportedDocument, NewChunk, PutResult, StoredChunk, StoredDocument,
    chunk_pages,
)

logger = logging.getLogger(__name__)

__all__ = ["Changes", "DocumentStore", "DocumentSummaryRow", "ExportedDocument", "NewChunk", "PutResult",
           "SqliteDocumentStore", "StoredChunk", "StoredDocument"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    title TEXT,
    metadata TEXT NOT NULL,
    num_chars INTEGER NOT NULL,
    created_at REAL NOT NULL,
    content_hash TEXT          -- what the document was built from: re-sending it is a no-op
);
CREATE TABLE IF NOT EXISTS chunks (
    row_id INTEGER PRIMARY KEY AUTOINCREMENT,   -- the FAISS id; never reused
    id TEXT NOT NULL UNIQUE,
    document_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    text TEXT NOT NULL,
    token_ids TEXT NOT NULL,
    kv_key TEXT,
    embedding BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks(document_id, position);
"""


def add_lexical_index(conn: sqlite3.Connection) -> int:
    """The chunks' full-text index (FTS5, rowid = the chunk's row id; Porter stemming over Unicode
    words), created if missing, then made to hold exactly the chunks' rows: a store made before it is
    backfilled in place, and a row whose chunk is gone is dropped. Idempotent; returns the rows added.
    Written in the same transaction as the chunks by every write (put_document, delete_document)."""
    conn.execute("CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, "
                 "tokenize = 'porter unicode61 remove_diacritics 2')")
    conn.execute("DELETE FROM chunks_fts WHERE rowid NOT IN (SELECT row_id FROM chunks)")
    return conn.execute("INSERT INTO chunks_fts (rowid, text) SELECT row_id, text FROM chunks"
                        " WHERE row_id NOT IN (SELECT rowid FROM chunks_fts)").rowcount


class SqliteDocumentStore(DocumentStore):
    """Thread-safe (one connection behind a lock); every write is one transaction."""

    is_shared = False  # one process owns the file: no change log to follow

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA foreign_keys = ON")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.executescript(_SCHEMA)
        columns = {r["name"] for r in self._conn.execute("PRAGMA table_info(documents)")}
        if "content_hash" not in columns:  # a store made before content hashes
            self._conn.execute("ALTER TABLE documents ADD COLUMN content_hash TEXT")
        with self._transaction():
            num_backfilled = add_lexical_index(self._conn)
        if num_backfilled:
            logger.info("lexical index: %d chunks indexed (a store made before it)", num_backfilled)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk],
        content_hash: str | None = None,
    ) -> PutResult:
        """Insert (or replace) a document and its chunks in one transaction: after a crash either the
        old or the new version is stored, never a mix. Nothing is written when `content_hash` is
        already stored for `doc_id`."""
        with self._lock, self._transaction():
            if content_hash is not None:
                row = self._conn.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
                if row is not None and row["content_hash"] == content_hash:
                    return PutResult(_document(row, self._chunks_where("c.document_id = ?", (doc_id,))), [], True)
            replaced = self._chunks_where("c.document_id = ?", (doc_id,))
            self._delete_lexical(replaced)
            self._conn.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
            now = time.time()
            self._conn.execute(
                "INSERT INTO documents (id, title, metadata, num_chars, created_at, content_hash)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (doc_id, title, json.dumps(metadata), num_chars, now, content_hash),
            )
            for position, chunk in enumerate(chunks):
                self._conn.execute(
                    "INSERT INTO chunks (id, document_id, position, text, token_ids, kv_key, embedding)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (f"{doc_id}#{position}", doc_id, position, chunk.text, json.dumps(list(chunk.token_ids)),
                     chunk.kv_key, np.asarray(chunk.embedding, dtype=np.float32).tobytes()),
                )
            stored = self._chunks_where("c.document_id = ?", (doc_id,))
            self._conn.executemany("INSERT INTO chunks_fts (rowid, text) VALUES (?, ?)",
                                   [(c.row_id, c.text) for c in stored])
        return PutResult(StoredDocument(doc_id, title, metadata, num_chars, now, stored), replaced)

    def delete_document(self, doc_id: str) -> list[StoredChunk] | None:
        """Delete a document; returns its chunks, or None when there was no such document."""
        with self._lock, self._transaction():
            if self._conn.execute("SELECT 1 FROM documents WHERE id = ?", (doc_id,)).fetchone() is None:
                return None
            chunks = self._chunks_where("c.document_id = ?", (doc_id,))
            self._delete_lexical(chunks)
            self._conn.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
        return chunks

    def _delete_lexical(self, chunks: Sequence[StoredChunk]) -> None:
        self._conn.executemany("DELETE FROM chunks_fts WHERE rowid = ?", [(c.row_id,) for c in chunks])

    def lexical_search(self, question: str, limit: int) -> list[tuple[int, float]]:
        """(row id, BM25 score: higher is better) of the chunks holding any of the question's words
        (stemmed, stop words left out), best first."""
        terms = query_terms(question)
        if not terms:
            return []
        with self._lock:
            rows = self._conn.execute("SELECT rowid, rank FROM chunks_fts WHERE chunks_fts MATCH ? ORDER BY rank LIMIT ?",
                                      (fts5_query(terms), limit)).fetchall()
        return [(int(r[0]), -float(r[1])) for r in rows]  # FTS5's rank (its bm25) is negated

    def get_document(self, doc_id: str) -> StoredDocument | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
            if row is None:
                return None
            return _document(row, self._chunks_where("c.document_id = ?", (doc_id,)))

    def content_hash(self, doc_id: str) -> str | None:
        """The hash a stored document was built from (None: no such document, or stored before hashes)."""
        with self._lock:
            row = self._conn.execute("SELECT content_hash FROM documents WHERE id = ?", (doc_id,)).fetchone()
        return None if row is None else row["content_hash"]

    def list_documents(self, limit: int = 100, offset: int = 0) -> list[DocumentSummaryRow]:
        """One page of documents with their chunk counts, in one query (no chunk rows are read)."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT d.id, d.title, d.num_chars, d.created_at,"
                " (SELECT COUNT(*) FROM chunks c WHERE c.document_id = d.id) AS num_chunks"
                " FROM documents d ORDER BY d.created_at, d.id LIMIT ? OFFSET ?", (limit, offset)
            ).fetchall()
        return [DocumentSummaryRow(r["id"], r["title"], r["num_chunks"], r["num_chars"], r["created_at"]) for r in rows]

    def chunks_by_row_ids(self, row_ids: Sequence[int]) -> dict[int, StoredChunk]:
        return {c.row_id: c for c in self._chunks_in("row_id", list(row_ids))}

    def chunks_by_ids(self, chunk_ids: Sequence[str]) -> dict[str, StoredChunk]:
        return {c.id: c for c in self._chunks_in("id", list(chunk_ids))}

    def set_kv_key(self, chunk_id: str, kv_key: str | None) -> None:
        with self._lock:
            self._conn.execute("UPDATE chunks SET kv_key = ? WHERE id = ?", (kv_key, chunk_id))

    def is_kv_key_used(self, kv_key: str) -> bool:
        """Whether any chunk still points at this (content-addressed, so shareable) KV entry."""
        with self._lock:
            return self._conn.execute("SELECT 1 FROM chunks WHERE kv_key = ? LIMIT 1", (kv_key,)).fetchone() is not None

    def num_documents(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def kv_keys_by_document(self, doc_ids: Sequence[str]) -> dict[str, list[str | None]]:
        """Each document's chunks' KV keys, in position order (one query; no text or token ids read)."""
        out: dict[str, list[str | None]] = {doc_id: [] for doc_id in doc_ids}
        with self._lock:
            for start in range(0, len(doc_ids), 500):  # SQLite caps the number of bound parameters
                part = list(doc_ids[start : start + 500])
                marks = ",".join("?" * len(part))
                for r in self._conn.execute(f"SELECT document_id, kv_key FROM chunks WHERE document_id IN ({marks})"
                                            " ORDER BY document_id, position", part):
                    out[r[0]].append(r[1])
        return out

    def num_chunk_tokens(self) -> int:
        """Tokens over every chunk (overlaps counted in each chunk): what the collection's KV covers."""
        with self._lock:
            row = self._conn.execute("SELECT COALESCE(SUM(json_array_length(token_ids)), 0) FROM chunks").fetchone()
        return int(row[0])

    def num_chunks(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

    def row_ids(self) -> set[int]:
        """Every chunk's row id: what the vector index must hold, exactly."""
        with self._lock:
            return {int(r[0]) for r in self._conn.execute("SELECT row_id FROM chunks")}

    def kv_keys(self) -> set[str]:
        """Every KV key a chunk points at: the KV entries that must not be garbage-collected."""
        with self._lock:
            return {r[0] for r in self._conn.execute("SELECT DISTINCT kv_key FROM chunks WHERE kv_key IS NOT NULL")}

    def embeddings_of(self, row_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(row_ids [n] int64, embeddings [n, dim] float32) of these chunks (those that exist)."""
        with self._lock:
            rows = []
            for start in range(0, len(row_ids), 500):  # SQLite caps the number of bound parameters
                part = list(row_ids[start : start + 500])
                marks = ",".join("?" * len(part))
                rows += self._conn.execute(
                    f"SELECT row_id, embedding FROM chunks WHERE row_id IN ({marks}) ORDER BY row_id", part
                ).fetchall()
        ids = np.array([r["row_id"] for r in rows], dtype=np.int64)
        vectors = [np.frombuffer(r["embedding"], dtype=np.float32) for r in rows]
        return ids, (np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32))

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(row_ids [n] int64, embeddings [n, dim] float32) batches of every chunk, for index rebuilds."""
        with self._lock:
            rows = self._conn.execute("SELECT row_id, embedding FROM chunks ORDER BY row_id").fetchall()
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            ids = np.array([r["row_id"] for r in batch], dtype=np.int64)
            yield ids, np.stack([np.frombuffer(r["embedding"], dtype=np.float32) for r in batch])

    def change_seq(self) -> int:
        return 0  # nobody else writes this file: the index follows this process's own writes

    def changes_since(self, seq: int) -> Changes:
        return Changes(0, frozenset())

    def export_documents(self) -> Iterator[ExportedDocument]:
        with self._lock:
            doc_ids = [r["id"] for r in self._conn.execute("SELECT id FROM documents ORDER BY created_at, id")]
        for doc_id in doc_ids:
            with self._lock:
                row = self._conn.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
                if row is None:  # deleted meanwhile
                    continue
                rows = self._conn.execute(
                    "SELECT text, token_ids, kv_key, embedding FROM chunks WHERE document_id = ? ORDER BY position",
                    (doc_id,),
                ).fetchall()
            chunks = [NewChunk(r["text"], tuple(json.loads(r["token_ids"])), np.frombuffer(r["embedding"], np.float32),
                               r["kv_key"]) for r in rows]
            yield ExportedDocument(_document(row, []), row["content_hash"], chunks)

    def _chunks_in(self, column: str, values: list[Any]) -> list[StoredChunk]:
        if not values:
            return []
        with self._lock:
            marks = ",".join("?" * len(values))
            return self._chunks_where(f"c.{column} IN ({marks})", tuple(values))

    def _chunks_where(self, where: str, params: tuple[Any, ...]) -> list[StoredChunk]:
        rows = self._conn.execute(
            "SELECT c.row_id, c.id, c.document_id, c.position, c.text, c.token_ids, c.kv_key, d.title,"
            # an uploaded PDF's pages per chunk (metadata.chunk_pages / chunk_last_pages, by position)
            " json_extract(d.metadata, '$.chunk_pages[' || c.position || ']') AS first_page,"
            " json_extract(d.metadata, '$.chunk_last_pages[' || c.position || ']') AS last_page"
            f" FROM chunks c JOIN documents d ON d.id = c.document_id WHERE {where} ORDER BY c.document_id, c.position",
            params,
        ).fetchall()
        return [
            StoredChunk(r["row_id"], r["id"], r["document_id"], r["position"], r["text"],
                        tuple(json.loads(r["token_ids"])), r["kv_key"], r["title"], chunk_pages(r["first_page"], r["last_page"]))
            for r in rows
        ]

    def _transaction(self) -> _Transaction:
        return _Transaction(self._conn)


class _Transaction:
    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._conn.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _document(row: sqlite3.Row, chunks: list[StoredChunk]) -> StoredDocument:
    return StoredDocument(row["id"], row["title"], json.loads(row["metadata"]), row["num_chars"],
                          row["created_at"], chunks)
