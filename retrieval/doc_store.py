"""SQLite document store (the embedded default, one process): collections, their documents and chunks
(text, token ids, KV key, embedding), and API keys. The interface and row types: retrieval/store_types.py.

The schema's version is SQLite's `user_version`; `_MIGRATIONS` is the numbered list of steps from one
version to the next, each run in one transaction when the store opens (a crash mid-migration leaves
the older version whole). A new step is appended; a step is never edited once released."""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Sequence

import numpy as np

from retrieval.lexical import COMMON_TERM_SHARE, MOST_TERM_SHARE, fts5_query, query_terms
from retrieval.store_types import (
    entry_name_hits,
    DEFAULT_COLLECTION, Changes, ChunkTokens, CollectionCounts, CollectionExistsError, CollectionNotFoundError,
    CollectionRow, DocumentStore, DocumentSummaryRow, EmbeddingBatch, ExportedDocument, FusedHit, KeyRow, NewChunk,
    PutResult, StoredChunk, StoredDocument, chunk_id_of, chunk_pages, rows_of_ranking,
)

__all__ = ["Changes", "DocumentStore", "DocumentSummaryRow", "ExportedDocument", "NewChunk", "PutResult",
           "SqliteDocumentStore", "StoredChunk", "StoredDocument"]

logger = logging.getLogger(__name__)

# The full-text index's tokenizer (schema migration 3), and the one a question's words are read with
FTS_TOKENIZER = "porter unicode61 remove_diacritics 2"


def _migrate_1(conn: sqlite3.Connection) -> None:
    """Documents and chunks (the first schema; a store made before content hashes gains the column)."""
    conn.execute("""CREATE TABLE IF NOT EXISTS documents (
        id TEXT PRIMARY KEY,
        title TEXT,
        metadata TEXT NOT NULL,
        num_chars INTEGER NOT NULL,
        created_at REAL NOT NULL,
        content_hash TEXT          -- what the document was built from: re-sending it is a no-op
    )""")
    conn.execute("""CREATE TABLE IF NOT EXISTS chunks (
        row_id INTEGER PRIMARY KEY AUTOINCREMENT,   -- the FAISS id; never reused
        id TEXT NOT NULL UNIQUE,
        document_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        text TEXT NOT NULL,
        token_ids TEXT NOT NULL,
        kv_key TEXT,
        embedding BLOB NOT NULL
    )""")
    conn.execute("CREATE INDEX IF NOT EXISTS chunks_by_document ON chunks(document_id, position)")
    columns = {r[1] for r in conn.execute("PRAGMA table_info(documents)")}
    if "content_hash" not in columns:
        conn.execute("ALTER TABLE documents ADD COLUMN content_hash TEXT")


def _migrate_2(conn: sqlite3.Connection) -> None:
    """Collections and API keys: every existing document lands in `default` (unsalted KV: its chunks'
    stored keys stay valid). A document is now keyed by (collection, id), so both tables are rebuilt
    (SQLite cannot change a primary key); chunk row ids and the AUTOINCREMENT high-water mark are
    kept, so no id is ever reused."""
    conn.execute("""CREATE TABLE collections (
        name TEXT PRIMARY KEY,
        description TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        kv_salt TEXT NOT NULL,                      -- part of its chunks' KV keys
        shares_kv INTEGER NOT NULL DEFAULT 0,
        kv_budget_bytes INTEGER                     -- its own KV budget; NULL: the store's only
    )""")
    conn.execute("INSERT INTO collections (name, created_at, kv_salt) VALUES (?, ?, '')",
                 (DEFAULT_COLLECTION, time.time()))
    for name in ("chunks_by_document", "chunks_by_kv_key"):
        conn.execute(f"DROP INDEX IF EXISTS {name}")
    conn.execute("ALTER TABLE chunks RENAME TO chunks_v1")
    conn.execute("ALTER TABLE documents RENAME TO documents_v1")
    conn.execute("""CREATE TABLE documents (
        collection TEXT NOT NULL REFERENCES collections(name) ON DELETE CASCADE,
        id TEXT NOT NULL,
        title TEXT,
        metadata TEXT NOT NULL,
        num_chars INTEGER NOT NULL,
        created_at REAL NOT NULL,
        content_hash TEXT,
        PRIMARY KEY (collection, id)
    )""")
    conn.execute("""CREATE TABLE chunks (
        row_id INTEGER PRIMARY KEY AUTOINCREMENT,   -- the FAISS id; never reused
        id TEXT NOT NULL UNIQUE,                    -- store_types.chunk_id_of: unique across collections
        collection TEXT NOT NULL,
        document_id TEXT NOT NULL,
        position INTEGER NOT NULL,
        text TEXT NOT NULL,
        token_ids TEXT NOT NULL,
        kv_key TEXT,
        embedding BLOB NOT NULL,
        FOREIGN KEY (collection, document_id) REFERENCES documents(collection, id) ON DELETE CASCADE
    )""")
    conn.execute("INSERT INTO documents (collection, id, title, metadata, num_chars, created_at, content_hash)"
                 " SELECT ?, id, title, metadata, num_chars, created_at, content_hash FROM documents_v1",
                 (DEFAULT_COLLECTION,))
    conn.execute("INSERT INTO chunks (row_id, id, collection, document_id, position, text, token_ids, kv_key,"
                 " embedding) SELECT row_id, id, ?, document_id, position, text, token_ids, kv_key, embedding"
                 " FROM chunks_v1", (DEFAULT_COLLECTION,))
    row = conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'chunks_v1'").fetchone()
    high_water = max(int(row[0]) if row else 0, int(conn.execute("SELECT COALESCE(MAX(row_id), 0) FROM chunks")
                                                   .fetchone()[0]))
    conn.execute("DROP TABLE chunks_v1")
    conn.execute("DROP TABLE documents_v1")
    conn.execute("DELETE FROM sqlite_sequence WHERE name = 'chunks'")
    conn.execute("INSERT INTO sqlite_sequence (name, seq) VALUES ('chunks', ?)", (high_water,))
    conn.execute("CREATE INDEX chunks_by_document ON chunks(collection, document_id, position)")
    conn.execute("CREATE INDEX chunks_by_kv_key ON chunks(kv_key)")
    conn.execute("""CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL DEFAULT '',
        token_hash TEXT NOT NULL,                   -- sha256 of the token (shown once, never stored)
        role TEXT NOT NULL,
        created_at REAL NOT NULL,
        revoked_at REAL
    )""")
    conn.execute("""CREATE TABLE key_collections (
        key_id TEXT NOT NULL REFERENCES api_keys(id) ON DELETE CASCADE,
        collection TEXT NOT NULL REFERENCES collections(name) ON DELETE CASCADE,  -- a deleted collection's grants go
        PRIMARY KEY (key_id, collection)
    )""")
    problems = conn.execute("PRAGMA foreign_key_check").fetchall()
    if problems:
        raise RuntimeError(f"migration 2 left {len(problems)} rows whose references do not hold: {problems[:3]}")


def _migrate_3(conn: sqlite3.Connection) -> None:
    """The chunks' full-text index (add_lexical_index), backfilled for the chunks already stored."""
    num_backfilled = add_lexical_index(conn)
    if num_backfilled:
        logger.info("lexical index: %d chunks indexed (a store made before it)", num_backfilled)


# Index i holds the step from version i to i + 1. Append new steps; never edit a released one.
_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_1, _migrate_2, _migrate_3)
SCHEMA_VERSION = len(_MIGRATIONS)

_CHUNK_COLUMNS = (
    "c.row_id, c.id, c.document_id, c.position, c.text, c.token_ids, c.kv_key, d.title,"
    # an uploaded PDF's pages per chunk (metadata.chunk_pages / chunk_last_pages, by position)
    " json_extract(d.metadata, '$.chunk_pages[' || c.position || ']') AS first_page,"
    " json_extract(d.metadata, '$.chunk_last_pages[' || c.position || ']') AS last_page, c.collection"
)
_DOCUMENT_COLUMNS = "collection, id, title, metadata, num_chars, created_at, content_hash"


def add_lexical_index(conn: sqlite3.Connection) -> int:
    """The chunks' full-text index (FTS5, rowid = the chunk's row id; Porter stemming over Unicode
    words), created if missing, then made to hold exactly the chunks' rows: a store made before it is
    backfilled in place, and a row whose chunk is gone is dropped. Idempotent; returns the rows added.
    Schema migration 3; from then on every write (put_document, delete_document) writes it in the same
    transaction as the chunks."""
    conn.execute(f"CREATE VIRTUAL TABLE IF NOT EXISTS chunks_fts USING fts5(text, tokenize = '{FTS_TOKENIZER}')")
    conn.execute("DELETE FROM chunks_fts WHERE rowid NOT IN (SELECT row_id FROM chunks)")
    return conn.execute("INSERT INTO chunks_fts (rowid, text) SELECT row_id, text FROM chunks"
                        " WHERE row_id NOT IN (SELECT rowid FROM chunks_fts)").rowcount


def lexical_query(num_collections: int) -> str:
    """`lexical_search`'s statement: the index's matches ranked by BM25, kept if their chunk is in one of
    the collections. Ordered by the index's rank, SQLite takes the matches as the outer loop and looks
    each chunk up by its key (tests/test_lexical.py asserts the plan; `missing_word_query` needed CROSS
    JOIN for that, having no ORDER BY)."""
    marks = ",".join("?" * num_collections)
    return ("SELECT f.rowid, f.rank FROM chunks_fts f JOIN chunks c ON c.row_id = f.rowid"
            f" WHERE chunks_fts MATCH ? AND c.collection IN ({marks}) ORDER BY f.rank LIMIT ?")


def missing_word_query(num_collections: int) -> str:
    """One word's test for `missing_words`: a row if any chunk of the collections holds it. CROSS JOIN keeps
    the index's matches the outer loop: joined the other way round, SQLite walked every chunk of the
    collections and probed the match per row (p99 ~170 ms at 10 000 chunks, `ragblend bench retrieval`)."""
    marks = ",".join("?" * num_collections)
    return ("SELECT 1 FROM chunks_fts f CROSS JOIN chunks c ON c.row_id = f.rowid"
            f" WHERE chunks_fts MATCH ? AND c.collection IN ({marks}) LIMIT 1")


def name_hit_query(num_collections: int) -> str:
    """One name's chunks for `name_hits`, at most `?` of them, in no order (a count decides, not a rank):
    the index's matches the outer loop, as in `missing_word_query`."""
    marks = ",".join("?" * num_collections)
    return ("SELECT f.rowid, c.document_id, d.title FROM chunks_fts f CROSS JOIN chunks c ON c.row_id = f.rowid"
            " JOIN documents d ON d.collection = c.collection AND d.id = c.document_id"
            f" WHERE chunks_fts MATCH ? AND c.collection IN ({marks}) LIMIT ?")


def _create_question_tables(conn: sqlite3.Connection) -> None:
    """This connection's temporary tables for `_rare_terms`: the index's vocabulary (term, chunks
    holding it), and a scratch FTS5 table with the index's tokenizer whose vocabulary gives a
    question's words as the index stores them. Temporary: no schema change, nothing on disk."""
    conn.execute("CREATE VIRTUAL TABLE temp.chunks_fts_vocab USING fts5vocab(main, chunks_fts, 'row')")
    conn.execute(f"CREATE VIRTUAL TABLE temp.question_words USING fts5(text, tokenize = '{FTS_TOKENIZER}')")
    conn.execute("CREATE VIRTUAL TABLE temp.question_words_vocab USING fts5vocab(temp, question_words, 'instance')")


class SqliteDocumentStore(DocumentStore):
    """Thread-safe (one connection behind a lock); every write is one transaction."""

    is_shared = False  # one process owns the file: no change log to follow

    def __init__(self, path: Path | str):
        self.path = Path(path)
        if str(path) != ":memory:":
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        self._conn.execute("PRAGMA journal_mode = WAL")
        try:
            self._migrate()
        except BaseException:
            self._conn.close()
            raise
        self._conn.execute("PRAGMA foreign_keys = ON")
        _create_question_tables(self._conn)
        self._total_chunks: int | None = None  # every collection's, for `_rare_terms`; None: to be counted
        self._lock = threading.Lock()

    def _migrate(self) -> None:
        """Bring the file up to SCHEMA_VERSION, one step per transaction; refuse a newer one. Foreign
        keys are off meanwhile (a table rebuild would otherwise cascade its deletes); each step checks
        them before its commit."""
        version = int(self._conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"the document store {self.path} is schema version {version}, made by a newer "
                               f"ragblend; this one knows versions up to {SCHEMA_VERSION}")
        self._conn.execute("PRAGMA foreign_keys = OFF")
        for number in range(version + 1, SCHEMA_VERSION + 1):
            with _Transaction(self._conn):
                _MIGRATIONS[number - 1](self._conn)
                self._conn.execute(f"PRAGMA user_version = {number}")
            if version > 0 or number > 1:
                logger.info("document store %s migrated to schema version %d", self.path, number)

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # --- documents ---------------------------------------------------------------------------------
    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk],
        content_hash: str | None = None, collection: str = DEFAULT_COLLECTION,
    ) -> PutResult:
        """Insert (or replace) a document and its chunks in one transaction: after a crash either the
        old or the new version is stored, never a mix. Nothing is written when `content_hash` is
        already stored for `doc_id`."""
        where = ("c.collection = ? AND c.document_id = ?", (collection, doc_id))
        with self._lock, self._transaction():
            if self._conn.execute("SELECT 1 FROM collections WHERE name = ?", (collection,)).fetchone() is None:
                raise CollectionNotFoundError(f"collection not found: {collection}")
            if content_hash is not None:
                row = self._document_row(collection, doc_id)
                if row is not None and row["content_hash"] == content_hash:
                    return PutResult(_document(row, self._chunks_where(*where)), [], True)
            replaced = self._chunks_where(*where)
            self._delete_lexical(replaced)
            self._conn.execute("DELETE FROM documents WHERE collection = ? AND id = ?", (collection, doc_id))
            now = time.time()
            self._conn.execute(
                f"INSERT INTO documents ({_DOCUMENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (collection, doc_id, title, json.dumps(metadata), num_chars, now, content_hash),
            )
            for position, chunk in enumerate(chunks):
                self._conn.execute(
                    "INSERT INTO chunks (id, collection, document_id, position, text, token_ids, kv_key, embedding)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (chunk_id_of(collection, doc_id, position), collection, doc_id, position, chunk.text,
                     json.dumps(list(chunk.token_ids)), chunk.kv_key,
                     np.asarray(chunk.embedding, dtype=np.float32).tobytes()),
                )
            stored = self._chunks_where(*where)
            self._conn.executemany("INSERT INTO chunks_fts (rowid, text) VALUES (?, ?)",
                                   [(c.row_id, c.text) for c in stored])
        return PutResult(StoredDocument(doc_id, title, metadata, num_chars, now, stored, collection), replaced)

    def delete_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> list[StoredChunk] | None:
        """Delete a document; returns its chunks, or None when there was no such document."""
        with self._lock, self._transaction():
            if self._document_row(collection, doc_id) is None:
                return None
            chunks = self._chunks_where("c.collection = ? AND c.document_id = ?", (collection, doc_id))
            self._delete_lexical(chunks)
            self._conn.execute("DELETE FROM documents WHERE collection = ? AND id = ?", (collection, doc_id))
        return chunks

    def _delete_lexical(self, chunks: Sequence[StoredChunk]) -> None:
        self._conn.executemany("DELETE FROM chunks_fts WHERE rowid = ?", [(c.row_id,) for c in chunks])

    def lexical_search(self, question: str, limit: int, collections: Sequence[str]) -> list[tuple[int, float]]:
        """(row id, BM25 score: higher is better) of `collections`' chunks holding any of the question's
        words (stemmed, stop words left out), best first."""
        terms = query_terms(question)
        if not terms or not collections:
            return []
        with self._lock:
            terms = self._rare_terms(terms)
            rows = self._conn.execute(lexical_query(len(collections)),
                                      (fts5_query(terms), *collections, limit)).fetchall()
        return [(int(r[0]), -float(r[1])) for r in rows]  # FTS5's rank (its bm25) is negated

    def missing_words(self, words: Sequence[str], collections: Sequence[str]) -> list[str]:
        """The `words` no chunk of `collections` holds (each one FTS5 query, stemmed as the index is)."""
        if not words or not collections:
            return list(words)
        query = missing_word_query(len(collections))
        with self._lock:
            return [w for w in words if self._conn.execute(query, (fts5_query([w]), *collections)).fetchone() is None]

    def name_hits(self, names: Sequence[str], limit: int, collections: Sequence[str]) -> dict[str, list[int]]:
        """Each name one FTS5 phrase query (its words in order: "fail_interval" is the phrase "fail interval"),
        asked for `limit` + 1 chunks: one more than `limit` leaves the name out."""
        if not names or not collections or limit < 1:
            return {}
        query = name_hit_query(len(collections))
        with self._lock:
            rows = {name: self._conn.execute(query, (fts5_query([name]), *collections, limit + 1)).fetchall()
                    for name in names}
        return entry_name_hits(names, {name: [(int(r[0]), r[1], r[2]) for r in found] for name, found in rows.items()},
                               limit)

    def _rare_terms(self, terms: list[str]) -> list[str]:
        """The `terms` found in at most COMMON_TERM_SHARE of the chunks; if none, those in at most
        MOST_TERM_SHARE; if none, all of them: as Postgres's search leaves the others out. A word's share
        is its index terms' (FTS5 stems "one" to "on", which is in most chunks): the word is tokenized by
        the index's own tokenizer, in a temporary FTS5 table, and its terms' document counts read from
        the index's vocabulary. A word is kept if any of its terms is rare ("dir_mode" is two)."""
        self._conn.execute("DELETE FROM temp.question_words")
        self._conn.executemany("INSERT INTO temp.question_words (rowid, text) VALUES (?, ?)", enumerate(terms))
        stems = self._conn.execute("SELECT doc, term FROM temp.question_words_vocab").fetchall()
        marks = ",".join("?" * len(stems))
        counts = dict(self._conn.execute(f"SELECT term, doc FROM temp.chunks_fts_vocab WHERE term IN ({marks})",
                                         [term for _, term in stems]).fetchall())
        if self._total_chunks is None:  # a count is a scan (~1 ms at 100 000 chunks): once per write
            self._total_chunks = int(self._conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])
        for share in (COMMON_TERM_SHARE, MOST_TERM_SHARE):
            most = share * self._total_chunks
            kept = sorted({int(word) for word, term in stems if 0 < counts.get(term, 0) <= most})
            if kept:
                return [terms[i] for i in kept]
        return terms  # a word in no chunk neither matches nor is a reason to drop one that is

    def get_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> StoredDocument | None:
        with self._lock:
            row = self._document_row(collection, doc_id)
            if row is None:
                return None
            return _document(row, self._chunks_where("c.collection = ? AND c.document_id = ?", (collection, doc_id)))

    def content_hash(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> str | None:
        """The hash a stored document was built from (None: no such document, or stored before hashes)."""
        with self._lock:
            row = self._document_row(collection, doc_id)
        return None if row is None else row["content_hash"]

    def _document_row(self, collection: str, doc_id: str) -> sqlite3.Row | None:
        return self._conn.execute(f"SELECT {_DOCUMENT_COLUMNS} FROM documents WHERE collection = ? AND id = ?",
                                  (collection, doc_id)).fetchone()

    def list_documents(self, limit: int = 100, offset: int = 0,
                       collections: Sequence[str] = (DEFAULT_COLLECTION,)) -> list[DocumentSummaryRow]:
        """One page of documents with their chunk counts, in one query (no chunk rows are read)."""
        marks = ",".join("?" * len(collections))
        with self._lock:
            rows = self._conn.execute(
                "SELECT d.collection, d.id, d.title, d.num_chars, d.created_at,"
                " (SELECT COUNT(*) FROM chunks c WHERE c.collection = d.collection AND c.document_id = d.id)"
                f" AS num_chunks FROM documents d WHERE d.collection IN ({marks})"
                " ORDER BY d.created_at, d.collection, d.id LIMIT ? OFFSET ?", (*collections, limit, offset)
            ).fetchall()
        return [DocumentSummaryRow(r["id"], r["title"], r["num_chunks"], r["num_chars"], r["created_at"],
                                   r["collection"]) for r in rows]

    def collections_of_document(self, doc_id: str, collections: Sequence[str]) -> list[str]:
        marks = ",".join("?" * len(collections))
        with self._lock:
            return [r[0] for r in self._conn.execute(
                f"SELECT collection FROM documents WHERE id = ? AND collection IN ({marks}) ORDER BY collection",
                (doc_id, *collections))]

    def chunks_by_row_ids(self, row_ids: Sequence[int]) -> dict[int, StoredChunk]:
        return {c.row_id: c for c in self._chunks_in("row_id", list(row_ids))}

    def fused_rows(self, ranked: Sequence[tuple[int, float]], dense: Collection[int]) -> list[FusedHit]:
        return rows_of_ranking(self, ranked, dense)  # in process: no round trips to save

    def chunks_by_ids(self, chunk_ids: Sequence[str], collections: Sequence[str] | None = None) -> dict[str, StoredChunk]:
        found = {c.id: c for c in self._chunks_in("id", list(chunk_ids))}
        if collections is None:
            return found
        allowed = set(collections)
        return {chunk_id: c for chunk_id, c in found.items() if c.collection in allowed}

    def iter_chunks(self, batch_size: int = 1024) -> Iterator[list[StoredChunk]]:
        last = 0
        while True:  # keyset pages, one query each (as the Postgres store's): the lock is not held between
            with self._lock:
                chunks = self._chunks_where("c.row_id IN (SELECT row_id FROM chunks WHERE row_id > ?"
                                            " ORDER BY row_id LIMIT ?)", (last, batch_size))
            if not chunks:
                return
            chunks.sort(key=lambda c: c.row_id)
            last = chunks[-1].row_id
            yield chunks

    def set_chunk_embeddings(self, row_ids: Sequence[int], vectors: np.ndarray) -> None:
        rows = [(np.asarray(v, dtype=np.float32).tobytes(), int(i)) for i, v in zip(row_ids, vectors)]
        with self._lock, self._transaction():
            self._conn.executemany("UPDATE chunks SET embedding = ? WHERE row_id = ?", rows)

    def set_chunk_tokens(self, updates: Sequence[ChunkTokens]) -> None:
        with self._lock, self._transaction():
            self._conn.executemany("UPDATE chunks SET token_ids = ?, kv_key = ? WHERE id = ?",
                                   [(json.dumps(list(u.token_ids)), u.kv_key, u.chunk_id) for u in updates])

    def is_kv_key_used(self, kv_key: str) -> bool:
        """Whether any chunk still points at this (content-addressed, so shareable) KV entry."""
        return self.collection_of_kv_key(kv_key) is not None

    def collection_of_kv_key(self, kv_key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT collection FROM chunks WHERE kv_key = ? LIMIT 1", (kv_key,)).fetchone()
        return None if row is None else row[0]

    def num_documents(self, collections: Sequence[str] | None = None) -> int:
        where, params = _in_collections("collection", collections)
        with self._lock:
            return int(self._conn.execute(f"SELECT COUNT(*) FROM documents{where}", params).fetchone()[0])

    def kv_keys_by_document(self, doc_ids: Sequence[str],
                            collection: str = DEFAULT_COLLECTION) -> dict[str, list[str | None]]:
        """Each document's chunks' KV keys, in position order (one query; no text or token ids read)."""
        out: dict[str, list[str | None]] = {doc_id: [] for doc_id in doc_ids}
        with self._lock:
            for start in range(0, len(doc_ids), 500):  # SQLite caps the number of bound parameters
                part = list(doc_ids[start : start + 500])
                marks = ",".join("?" * len(part))
                for r in self._conn.execute(f"SELECT document_id, kv_key FROM chunks WHERE collection = ? AND"
                                            f" document_id IN ({marks}) ORDER BY document_id, position",
                                            (collection, *part)):
                    out[r[0]].append(r[1])
        return out

    def num_chunk_tokens(self, collections: Sequence[str] | None = None) -> int:
        """Tokens over every chunk (overlaps counted in each chunk): what the collections' KV covers."""
        where, params = _in_collections("collection", collections)
        with self._lock:
            row = self._conn.execute(
                f"SELECT COALESCE(SUM(json_array_length(token_ids)), 0) FROM chunks{where}", params).fetchone()
        return int(row[0])

    def num_chunks(self, collections: Sequence[str] | None = None) -> int:
        where, params = _in_collections("collection", collections)
        with self._lock:
            return int(self._conn.execute(f"SELECT COUNT(*) FROM chunks{where}", params).fetchone()[0])

    def row_ids(self) -> set[int]:
        """Every chunk's row id: what the vector indexes must hold, exactly."""
        with self._lock:
            return {int(r[0]) for r in self._conn.execute("SELECT row_id FROM chunks")}

    def kv_keys(self, collections: Sequence[str] | None = None) -> set[str]:
        """Every KV key a chunk points at: the KV entries that must not be garbage-collected."""
        where, params = _in_collections("collection", collections)
        where = f"{where} AND kv_key IS NOT NULL" if where else " WHERE kv_key IS NOT NULL"
        with self._lock:
            return {r[0] for r in self._conn.execute(f"SELECT DISTINCT kv_key FROM chunks{where}", params)}

    def embeddings_of(self, row_ids: Sequence[int]) -> EmbeddingBatch:
        """These chunks' (those that exist) row ids, embeddings and collections."""
        with self._lock:
            rows = []
            for start in range(0, len(row_ids), 500):  # SQLite caps the number of bound parameters
                part = list(row_ids[start : start + 500])
                marks = ",".join("?" * len(part))
                rows += self._conn.execute(
                    f"SELECT row_id, embedding, collection FROM chunks WHERE row_id IN ({marks}) ORDER BY row_id", part
                ).fetchall()
        return _embeddings(rows)

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[EmbeddingBatch]:
        """Every chunk's row id, embedding and collection, in batches, for index rebuilds."""
        with self._lock:
            rows = self._conn.execute("SELECT row_id, embedding, collection FROM chunks ORDER BY row_id").fetchall()
        for start in range(0, len(rows), batch_size):
            yield _embeddings(rows[start : start + batch_size])

    def change_seq(self) -> int:
        return 0  # nobody else writes this file: the index follows this process's own writes

    def changes_since(self, seq: int) -> Changes:
        return Changes(0, frozenset())

    def export_documents(self) -> Iterator[ExportedDocument]:
        with self._lock:
            keys = [(r[0], r[1]) for r in self._conn.execute(
                "SELECT collection, id FROM documents ORDER BY created_at, collection, id")]
        for collection, doc_id in keys:
            with self._lock:
                row = self._document_row(collection, doc_id)
                if row is None:  # deleted meanwhile
                    continue
                rows = self._conn.execute(
                    "SELECT text, token_ids, kv_key, embedding FROM chunks WHERE collection = ? AND document_id = ?"
                    " ORDER BY position", (collection, doc_id),
                ).fetchall()
            chunks = [NewChunk(r["text"], tuple(json.loads(r["token_ids"])), np.frombuffer(r["embedding"], np.float32),
                               r["kv_key"]) for r in rows]
            yield ExportedDocument(_document(row, []), row["content_hash"], chunks)

    # --- collections -------------------------------------------------------------------------------
    def create_collection(self, row: CollectionRow) -> CollectionRow:
        with self._lock:
            try:
                self._conn.execute(
                    "INSERT INTO collections (name, description, created_at, kv_salt, shares_kv, kv_budget_bytes)"
                    " VALUES (?, ?, ?, ?, ?, ?)",
                    (row.name, row.description, row.created_at, row.kv_salt, int(row.shares_kv), row.kv_budget_bytes))
            except sqlite3.IntegrityError:
                raise CollectionExistsError(f"collection exists: {row.name}") from None
        return row

    def get_collection(self, name: str) -> CollectionRow | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM collections WHERE name = ?", (name,)).fetchone()
        return None if row is None else _collection(row)

    def list_collections(self) -> list[CollectionRow]:
        with self._lock:
            return [_collection(r) for r in self._conn.execute("SELECT * FROM collections ORDER BY name")]

    def update_collection(self, row: CollectionRow) -> bool:
        with self._lock:
            cursor = self._conn.execute("UPDATE collections SET description = ?, kv_budget_bytes = ? WHERE name = ?",
                                        (row.description, row.kv_budget_bytes, row.name))
        return cursor.rowcount > 0

    def delete_collection(self, name: str) -> list[StoredChunk] | None:
        with self._lock, self._transaction():
            if self._conn.execute("SELECT 1 FROM collections WHERE name = ?", (name,)).fetchone() is None:
                return None
            chunks = self._chunks_where("c.collection = ?", (name,))
            # documents, chunks and key grants go with it (ON DELETE CASCADE), in this transaction;
            # the full-text table is virtual and takes no foreign key, so its rows go by hand
            self._delete_lexical(chunks)
            self._conn.execute("DELETE FROM collections WHERE name = ?", (name,))
        return chunks

    def collection_counts(self, names: Sequence[str]) -> dict[str, CollectionCounts]:
        marks = ",".join("?" * len(names))
        with self._lock:
            documents = dict(self._conn.execute(
                f"SELECT collection, COUNT(*) FROM documents WHERE collection IN ({marks}) GROUP BY collection",
                tuple(names)).fetchall())
            chunks = {r[0]: (int(r[1]), int(r[2])) for r in self._conn.execute(
                f"SELECT collection, COUNT(*), COALESCE(SUM(json_array_length(token_ids)), 0) FROM chunks"
                f" WHERE collection IN ({marks}) GROUP BY collection", tuple(names))}
        return {name: CollectionCounts(int(documents.get(name, 0)), *chunks.get(name, (0, 0))) for name in names}

    # --- API keys ----------------------------------------------------------------------------------
    def create_key(self, row: KeyRow) -> KeyRow:
        with self._lock, self._transaction():
            for name in row.collections:
                if self._conn.execute("SELECT 1 FROM collections WHERE name = ?", (name,)).fetchone() is None:
                    raise CollectionNotFoundError(f"collection not found: {name}")
            try:
                self._conn.execute(
                    "INSERT INTO api_keys (id, name, token_hash, role, created_at, revoked_at) VALUES (?, ?, ?, ?, ?, ?)",
                    (row.id, row.name, row.token_hash, row.role, row.created_at, row.revoked_at))
            except sqlite3.IntegrityError:
                raise CollectionExistsError(f"key id exists: {row.id}") from None
            self._conn.executemany("INSERT INTO key_collections (key_id, collection) VALUES (?, ?)",
                                   [(row.id, name) for name in sorted(set(row.collections))])
        return row

    def get_key(self, key_id: str) -> KeyRow | None:
        with self._lock:
            row = self._conn.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
            if row is None:
                return None
            grants = [r[0] for r in self._conn.execute(
                "SELECT collection FROM key_collections WHERE key_id = ? ORDER BY collection", (key_id,))]
        return _key(row, grants)

    def list_keys(self) -> list[KeyRow]:
        with self._lock:
            rows = self._conn.execute("SELECT * FROM api_keys ORDER BY created_at, id").fetchall()
            grants: dict[str, list[str]] = {}
            for key_id, collection in self._conn.execute(
                    "SELECT key_id, collection FROM key_collections ORDER BY collection"):
                grants.setdefault(key_id, []).append(collection)
        return [_key(r, grants.get(r["id"], [])) for r in rows]

    def has_live_keys(self) -> bool:
        with self._lock:
            return self._conn.execute("SELECT 1 FROM api_keys WHERE revoked_at IS NULL LIMIT 1").fetchone() is not None

    def revoke_key(self, key_id: str, revoked_at: float) -> bool:
        with self._lock:
            cursor = self._conn.execute("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL",
                                        (revoked_at, key_id))
        return cursor.rowcount > 0

    # --- helpers -----------------------------------------------------------------------------------
    def _chunks_in(self, column: str, values: list[Any]) -> list[StoredChunk]:
        if not values:
            return []
        with self._lock:
            out = []
            for start in range(0, len(values), 500):  # SQLite caps the number of bound parameters
                part = values[start : start + 500]
                out += self._chunks_where(f"c.{column} IN ({','.join('?' * len(part))})", tuple(part))
            return out

    def _chunks_where(self, where: str, params: tuple[Any, ...]) -> list[StoredChunk]:
        rows = self._conn.execute(
            f"SELECT {_CHUNK_COLUMNS} FROM chunks c JOIN documents d ON d.collection = c.collection"
            f" AND d.id = c.document_id WHERE {where} ORDER BY c.collection, c.document_id, c.position",
            params,
        ).fetchall()
        return [
            StoredChunk(r["row_id"], r["id"], r["document_id"], r["position"], r["text"],
                        tuple(json.loads(r["token_ids"])), r["kv_key"], r["title"],
                        chunk_pages(r["first_page"], r["last_page"]), r["collection"])
            for r in rows
        ]

    def _transaction(self) -> _Transaction:
        self._total_chunks = None  # every write goes through here: the count is read again after it
        return _Transaction(self._conn)


class _Transaction:
    def __init__(self, conn: sqlite3.Connection):
        self._conn = conn

    def __enter__(self) -> None:
        self._conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._conn.execute("COMMIT" if exc_type is None else "ROLLBACK")


def _in_collections(column: str, collections: Sequence[str] | None) -> tuple[str, tuple[str, ...]]:
    """A WHERE clause limiting `column` to `collections` (none: every collection), and its parameters."""
    if collections is None:
        return "", ()
    return f" WHERE {column} IN ({','.join('?' * len(collections))})", tuple(collections)


def _embeddings(rows: list[sqlite3.Row]) -> EmbeddingBatch:
    ids = np.array([r["row_id"] for r in rows], dtype=np.int64)
    vectors = [np.frombuffer(r["embedding"], dtype=np.float32) for r in rows]
    return EmbeddingBatch(ids, np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32),
                          tuple(r["collection"] for r in rows))


def _document(row: sqlite3.Row, chunks: list[StoredChunk]) -> StoredDocument:
    return StoredDocument(row["id"], row["title"], json.loads(row["metadata"]), row["num_chars"],
                          row["created_at"], chunks, row["collection"])


def _collection(row: sqlite3.Row) -> CollectionRow:
    return CollectionRow(row["name"], row["description"], row["created_at"], row["kv_salt"], bool(row["shares_kv"]),
                         row["kv_budget_bytes"])


def _key(row: sqlite3.Row, collections: list[str]) -> KeyRow:
    return KeyRow(row["id"], row["name"], row["token_hash"], row["role"], tuple(collections), row["created_at"],
                  row["revoked_at"])
