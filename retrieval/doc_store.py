"""SQLite document store: documents and their chunks (text, token ids, KV key, embedding)."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

_SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    title TEXT,
    metadata TEXT NOT NULL,
    num_chars INTEGER NOT NULL,
    created_at REAL NOT NULL
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


@dataclass(frozen=True)
class NewChunk:
    text: str
    token_ids: tuple[int, ...]
    embedding: np.ndarray  # [dim] float32
    kv_key: str | None = None


@dataclass(frozen=True)
class StoredChunk:
    row_id: int
    id: str
    document_id: str
    position: int
    text: str
    token_ids: tuple[int, ...]
    kv_key: str | None
    title: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StoredDocument:
    id: str
    title: str | None
    metadata: dict[str, Any]
    num_chars: int
    created_at: float
    chunks: list[StoredChunk] = field(default_factory=list)


class DocumentStore:
    """Thread-safe (one connection behind a lock); every write is one transaction."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA foreign_keys = ON")
        self._conn.execute("PRAGMA journal_mode = WAL")
        self._conn.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk]
    ) -> tuple[StoredDocument, list[StoredChunk]]:
        """Insert (or replace) a document and its chunks. Returns it and the chunks it replaced."""
        with self._lock, self._transaction():
            replaced = self._chunks_where("c.document_id = ?", (doc_id,))
            self._conn.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
            now = time.time()
            self._conn.execute(
                "INSERT INTO documents (id, title, metadata, num_chars, created_at) VALUES (?, ?, ?, ?, ?)",
                (doc_id, title, json.dumps(metadata), num_chars, now),
            )
            for position, chunk in enumerate(chunks):
                self._conn.execute(
                    "INSERT INTO chunks (id, document_id, position, text, token_ids, kv_key, embedding)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (f"{doc_id}#{position}", doc_id, position, chunk.text, json.dumps(list(chunk.token_ids)),
                     chunk.kv_key, np.asarray(chunk.embedding, dtype=np.float32).tobytes()),
                )
            stored = self._chunks_where("c.document_id = ?", (doc_id,))
        document = StoredDocument(doc_id, title, metadata, num_chars, now, stored)
        return document, replaced

    def delete_document(self, doc_id: str) -> list[StoredChunk] | None:
        """Delete a document; returns its chunks, or None when there was no such document."""
        with self._lock, self._transaction():
            if self._conn.execute("SELECT 1 FROM documents WHERE id = ?", (doc_id,)).fetchone() is None:
                return None
            chunks = self._chunks_where("c.document_id = ?", (doc_id,))
            self._conn.execute("DELETE FROM documents WHERE id = ?", (doc_id,))
        return chunks

    def get_document(self, doc_id: str) -> StoredDocument | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
            if row is None:
                return None
            return _document(row, self._chunks_where("c.document_id = ?", (doc_id,)))

    def list_documents(self, limit: int = 100, offset: int = 0) -> list[StoredDocument]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT * FROM documents ORDER BY created_at, id LIMIT ? OFFSET ?", (limit, offset)
            ).fetchall()
            return [_document(row, self._chunks_where("c.document_id = ?", (row["id"],))) for row in rows]

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

    def num_chunks(self) -> int:
        with self._lock:
            return int(self._conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(row_ids [n] int64, embeddings [n, dim] float32) batches of every chunk, for index rebuilds."""
        with self._lock:
            rows = self._conn.execute("SELECT row_id, embedding FROM chunks ORDER BY row_id").fetchall()
        for start in range(0, len(rows), batch_size):
            batch = rows[start : start + batch_size]
            ids = np.array([r["row_id"] for r in batch], dtype=np.int64)
            yield ids, np.stack([np.frombuffer(r["embedding"], dtype=np.float32) for r in batch])

    def _chunks_in(self, column: str, values: list[Any]) -> list[StoredChunk]:
        if not values:
            return []
        with self._lock:
            marks = ",".join("?" * len(values))
            return self._chunks_where(f"c.{column} IN ({marks})", tuple(values))

    def _chunks_where(self, where: str, params: tuple[Any, ...]) -> list[StoredChunk]:
        rows = self._conn.execute(
            "SELECT c.row_id, c.id, c.document_id, c.position, c.text, c.token_ids, c.kv_key, d.title"
            f" FROM chunks c JOIN documents d ON d.id = c.document_id WHERE {where} ORDER BY c.document_id, c.position",
            params,
        ).fetchall()
        return [
            StoredChunk(r["row_id"], r["id"], r["document_id"], r["position"], r["text"],
                        tuple(json.loads(r["token_ids"])), r["kv_key"], r["title"])
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
