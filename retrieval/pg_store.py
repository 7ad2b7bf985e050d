"""Postgres document store, shared by server replicas (`database.url`).

The same contract as the SQLite store (one transaction per document is its commit point, row ids are
never reused), plus a change log: every commit appends one row `(seq, row ids touched)` and notifies
`CHANNEL`, so each replica's vector index follows the others' writes (retrieval/follower.py).
Sequence numbers are taken under a transaction-scoped advisory lock held to the commit, so they
become visible in commit order: a replica that has read up to `seq` never misses a smaller one.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from retrieval.store_types import (
    Changes, DocumentStore, DocumentSummaryRow, ExportedDocument, NewChunk, PutResult, StoredChunk, StoredDocument,
    StoreUnavailableError, chunk_pages,
)

logger = logging.getLogger(__name__)

CHANNEL = "ragblend_changes"
SCHEMA_VERSION = 2
# Advisory lock ids (any constants unique to ragblend): schema creation, and the change sequence.
_SCHEMA_LOCK, _CHANGE_LOCK = 0x7261_6762_0001, 0x7261_6762_0002
_CHANGE_RETENTION_S = 86400.0  # change rows older than this are pruned; a replica further behind reconciles
_PRUNE_EVERY = 1000  # commits

LEXICAL_INDEX_SQL = """
ALTER TABLE chunks ADD COLUMN IF NOT EXISTS text_tsv tsvector
    GENERATED ALWAYS AS (to_tsvector('english', text)) STORED;
CREATE INDEX IF NOT EXISTS chunks_text_tsv ON chunks USING GIN (text_tsv);
"""

_MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE documents (
        id TEXT PRIMARY KEY,
        title TEXT,
        metadata JSONB NOT NULL,
        num_chars INTEGER NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        content_hash TEXT
    );
    CREATE TABLE chunks (
        row_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,   -- the FAISS id; never reused
        id TEXT NOT NULL UNIQUE,
        document_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        text TEXT NOT NULL,
        token_ids INTEGER[] NOT NULL,
        kv_key TEXT,
        embedding BYTEA NOT NULL                                  -- [dim] float32
    );
    CREATE INDEX chunks_by_document ON chunks(document_id, position);
    CREATE INDEX chunks_by_kv_key ON chunks(kv_key);
    CREATE TABLE changes (
        seq BIGINT PRIMARY KEY,
        document_id TEXT NOT NULL,
        row_ids BIGINT[] NOT NULL,                                -- chunks added or removed
        committed_at DOUBLE PRECISION NOT NULL
    );
    """,
    # The chunks' full-text index: a stored generated column (so every write fills it in the chunk's own
    # row, in the chunk's transaction, and ALTER TABLE backfills the rows already there) and its GIN
    # index. English stemming and stop words, as the SQLite store's FTS5 (Porter) and query.
    2: LEXICAL_INDEX_SQL,
}

COMMON_TERM_SHARE = 0.05  # a question word in more chunks than this share is matched only if nothing else is left
_LEXICAL_SEARCH = """
WITH stats AS (
    SELECT most_common_elems::text::text[] AS elems, most_common_elem_freqs AS freqs
    FROM pg_stats WHERE schemaname = current_schema() AND tablename = 'chunks' AND attname = 'text_tsv'),
common AS (
    SELECT e.elem FROM stats, unnest(stats.elems, stats.freqs[1:array_length(stats.elems, 1)]) AS e(elem, freq)
    WHERE e.freq > %(common)s),
asked AS (SELECT DISTINCT unnest(tsvector_to_array(to_tsvector('english', %(question)s))) AS term),
rare AS (SELECT term FROM asked WHERE term NOT IN (SELECT elem FROM common)),
terms AS (SELECT term FROM rare UNION ALL SELECT term FROM asked WHERE NOT EXISTS (SELECT 1 FROM rare)),
hits AS MATERIALIZED (
    SELECT t.term, c.row_id FROM terms t JOIN chunks c ON c.text_tsv @@ quote_literal(t.term)::tsquery),
df AS (SELECT term, count(*)::float8 AS n FROM hits GROUP BY term),
total AS (SELECT GREATEST((SELECT reltuples::float8 FROM pg_class WHERE oid = 'chunks'::regclass),
                          (SELECT max(n) FROM df)) AS n)
SELECT h.row_id, sum(ln((total.n - df.n + 0.5) / (df.n + 0.5) + 1.0)) AS score
FROM hits h JOIN df USING (term), total
GROUP BY h.row_id ORDER BY score DESC, h.row_id LIMIT %(limit)s
"""

# an uploaded PDF's pages per chunk (metadata.chunk_pages / chunk_last_pages, by position)
_CHUNK_COLUMNS = ("c.row_id, c.id, c.document_id, c.position, c.text, c.token_ids, c.kv_key, d.title,"
                  " d.metadata->'chunk_pages'->c.position, d.metadata->'chunk_last_pages'->c.position")


class PostgresDocumentStore(DocumentStore):
    """A connection pool (psycopg_pool); each call borrows one connection. Any connection failure is
    raised as StoreUnavailableError (the API answers 503): the failed call wrote nothing."""

    is_shared = True

    def __init__(self, url: str, max_connections: int = 8, timeout_s: float = 5.0):
        self.url, self.timeout_s = url, timeout_s
        self._pool = ConnectionPool(
            url, min_size=1, max_size=max_connections, timeout=timeout_s, open=False,
            check=ConnectionPool.check_connection,  # a connection dropped by a server restart is replaced
            kwargs={"connect_timeout": max(1, int(timeout_s))}, name="ragblend-store",
        )
        try:
            self._pool.open(wait=True, timeout=timeout_s)
        except PoolTimeout as exc:
            self._pool.close()
            raise StoreUnavailableError(f"cannot connect to the document store at {_redacted(url)} "
                                        f"within {timeout_s:g} s") from exc
        try:
            self._migrate()
        except BaseException:
            self._pool.close()
            raise

    def _migrate(self) -> None:
        """Create the schema on first start, or bring an older one up to SCHEMA_VERSION; refuse a newer
        one. Under an advisory lock: replicas starting together do it once."""
        with self._connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            conn.execute("CREATE TABLE IF NOT EXISTS ragblend_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM ragblend_schema").fetchone()
            version = 0 if row is None else int(row[0])
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"the database's schema is version {version}, made by a newer ragblend; "
                                   f"this one knows versions up to {SCHEMA_VERSION}")
            for number in range(version + 1, SCHEMA_VERSION + 1):
                conn.execute(_MIGRATIONS[number])
            if row is None:
                conn.execute("INSERT INTO ragblend_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
            elif version < SCHEMA_VERSION:
                conn.execute("UPDATE ragblend_schema SET version = %s", (SCHEMA_VERSION,))
            if version < SCHEMA_VERSION:
                logger.info("document store schema at version %d (was %d)", SCHEMA_VERSION, version)

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection]:
        try:
            with self._pool.connection() as conn:
                yield conn
        except PoolTimeout as exc:
            raise StoreUnavailableError(
                f"the document store (Postgres) did not answer within {self.timeout_s:g} s; retry later") from exc
        except psycopg.OperationalError as exc:
            raise StoreUnavailableError(f"the document store (Postgres) is unreachable: {_first_line(exc)}") from exc

    def close(self) -> None:
        self._pool.close()

    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk],
        content_hash: str | None = None,
    ) -> PutResult:
        with self._connection() as conn, conn.transaction():
            # One writer per document at a time: two replicas writing the same document serialize here,
            # and the second sees the first's content hash.
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (doc_id,))
            row = conn.execute("SELECT * FROM documents WHERE id = %s", (doc_id,)).fetchone()
            if content_hash is not None and row is not None and row[5] == content_hash:
                return PutResult(_document(row, self._chunks_where(conn, "c.document_id = %s", (doc_id,))), [], True)
            replaced = self._chunks_where(conn, "c.document_id = %s", (doc_id,))
            conn.execute("DELETE FROM documents WHERE id = %s", (doc_id,))
            now = time.time()
            conn.execute(
                "INSERT INTO documents (id, title, metadata, num_chars, created_at, content_hash)"
                " VALUES (%s, %s, %s, %s, %s, %s)",
                (doc_id, title, json.dumps(metadata), num_chars, now, content_hash),
            )
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO chunks (id, document_id, position, text, token_ids, kv_key, embedding)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s)",
                    [(f"{doc_id}#{position}", doc_id, position, chunk.text, list(chunk.token_ids), chunk.kv_key,
                      np.asarray(chunk.embedding, dtype=np.float32).tobytes())
                     for position, chunk in enumerate(chunks)],
                )
            stored = self._chunks_where(conn, "c.document_id = %s", (doc_id,))
            self._log_change(conn, doc_id, [c.row_id for c in replaced] + [c.row_id for c in stored])
        return PutResult(StoredDocument(doc_id, title, metadata, num_chars, now, stored), replaced)

    def _log_change(self, conn: psycopg.Connection, doc_id: str, row_ids: list[int]) -> None:
        """Append the commit to the change log and wake the replicas (NOTIFY is sent at the commit).
        The lock is held to the commit, so sequence order is commit order."""
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_CHANGE_LOCK,))
        seq = conn.execute(
            "INSERT INTO changes (seq, document_id, row_ids, committed_at)"
            " SELECT COALESCE(MAX(seq), 0) + 1, %s, %s, %s FROM changes RETURNING seq",
            (doc_id, row_ids, time.time()),
        ).fetchone()[0]
        if seq % _PRUNE_EVERY == 0:
            conn.execute("DELETE FROM changes WHERE committed_at < %s AND seq < %s",
                         (time.time() - _CHANGE_RETENTION_S, seq))
        conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, str(seq)))

    def delete_document(self, doc_id: str) -> list[StoredChunk] | None:
        with self._connection() as conn, conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (doc_id,))
            if conn.execute("SELECT 1 FROM documents WHERE id = %s", (doc_id,)).fetchone() is None:
                return None
            chunks = self._chunks_where(conn, "c.document_id = %s", (doc_id,))
            conn.execute("DELETE FROM documents WHERE id = %s", (doc_id,))
            self._log_change(conn, doc_id, [c.row_id for c in chunks])
        return chunks

    def get_document(self, doc_id: str) -> StoredDocument | None:
        with self._connection() as conn, conn.transaction():  # one snapshot: the document and its chunks agree
            row = conn.execute("SELECT * FROM documents WHERE id = %s", (doc_id,)).fetchone()
            if row is None:
                return None
            return _document(row, self._chunks_where(conn, "c.document_id = %s", (doc_id,)))

    def content_hash(self, doc_id: str) -> str | None:
        with self._connection() as conn:
            row = conn.execute("SELECT content_hash FROM documents WHERE id = %s", (doc_id,)).fetchone()
        return None if row is None else row[0]

    def list_documents(self, limit: int = 100, offset: int = 0) -> list[DocumentSummaryRow]:
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT d.id, d.title, d.num_chars, d.created_at,"
                " (SELECT COUNT(*) FROM chunks c WHERE c.document_id = d.id) AS num_chunks"
                " FROM documents d ORDER BY d.created_at, d.id LIMIT %s OFFSET %s", (limit, offset)
            ).fetchall()
        return [DocumentSummaryRow(r[0], r[1], int(r[4]), r[2], r[3]) for r in rows]

    def chunks_by_row_ids(self, row_ids: Sequence[int]) -> dict[int, StoredChunk]:
        if not row_ids:
            return {}
        with self._connection() as conn:
            chunks = self._chunks_where(conn, "c.row_id = ANY(%s)", ([int(i) for i in row_ids],))
        return {c.row_id: c for c in chunks}

    def chunks_by_ids(self, chunk_ids: Sequence[str]) -> dict[str, StoredChunk]:
        if not chunk_ids:
            return {}
        with self._connection() as conn:
            chunks = self._chunks_where(conn, "c.id = ANY(%s)", (list(chunk_ids),))
        return {c.id: c for c in chunks}

    def lexical_search(self, question: str, limit: int) -> list[tuple[int, float]]:
        """(row id, score: higher is better) of the chunks holding any of the question's words (English
        stems, stop words left out), best first. Postgres's own rankings (ts_rank, ts_rank_cd) weigh a
        word by its count in the chunk, not by its rarity, and cost a pass over every matching chunk's
        tsvector: so each chunk scores the sum of its matched words' inverse document frequencies (BM25's
        idf, from the matches themselves), and words in over COMMON_TERM_SHARE of the chunks (by the
        column's statistics) are left out of the match unless nothing else is left (they weigh little and
        would match thousands of chunks: docs/design/retrieval.md#lexical)."""
        with self._connection() as conn:
            rows = conn.execute(_LEXICAL_SEARCH, {"question": question, "common": COMMON_TERM_SHARE,
                                                  "limit": limit}).fetchall()
        return [(int(r[0]), float(r[1])) for r in rows]

    def set_kv_key(self, chunk_id: str, kv_key: str | None) -> None:
        with self._connection() as conn:
            conn.execute("UPDATE chunks SET kv_key = %s WHERE id = %s", (kv_key, chunk_id))

    def is_kv_key_used(self, kv_key: str) -> bool:
        with self._connection() as conn:
            return conn.execute("SELECT 1 FROM chunks WHERE kv_key = %s LIMIT 1", (kv_key,)).fetchone() is not None

    def num_documents(self) -> int:
        with self._connection() as conn:
            return int(conn.execute("SELECT COUNT(*) FROM documents").fetchone()[0])

    def num_chunks(self) -> int:
        with self._connection() as conn:
            return int(conn.execute("SELECT COUNT(*) FROM chunks").fetchone()[0])

    def row_ids(self) -> set[int]:
        with self._connection() as conn:
            return {int(r[0]) for r in conn.execute("SELECT row_id FROM chunks")}

    def kv_keys(self) -> set[str]:
        with self._connection() as conn:
            return {r[0] for r in conn.execute("SELECT DISTINCT kv_key FROM chunks WHERE kv_key IS NOT NULL")}

    def kv_keys_by_document(self, doc_ids: Sequence[str]) -> dict[str, list[str | None]]:
        out: dict[str, list[str | None]] = {doc_id: [] for doc_id in doc_ids}
        with self._connection() as conn:
            for doc_id, kv_key in conn.execute("SELECT document_id, kv_key FROM chunks WHERE document_id = ANY(%s)"
                                               " ORDER BY document_id, position", (list(doc_ids),)):
                out[doc_id].append(kv_key)
        return out

    def num_chunk_tokens(self) -> int:
        with self._connection() as conn:
            return int(conn.execute("SELECT COALESCE(SUM(cardinality(token_ids)), 0) FROM chunks").fetchone()[0])

    def embeddings_of(self, row_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        with self._connection() as conn:
            rows = conn.execute("SELECT row_id, embedding FROM chunks WHERE row_id = ANY(%s) ORDER BY row_id",
                                ([int(i) for i in row_ids],)).fetchall()
        return _embeddings(rows)

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        last = 0
        while True:  # keyset pages: no connection is held between batches
            with self._connection() as conn:
                rows = conn.execute("SELECT row_id, embedding FROM chunks WHERE row_id > %s ORDER BY row_id LIMIT %s",
                                    (last, batch_size)).fetchall()
            if not rows:
                return
            last = int(rows[-1][0])
            yield _embeddings(rows)

    def change_seq(self) -> int:
        with self._connection() as conn:
            return int(conn.execute("SELECT COALESCE(MAX(seq), 0) FROM changes").fetchone()[0])

    def changes_since(self, seq: int) -> Changes:
        with self._connection() as conn, conn.transaction():
            rows = conn.execute("SELECT seq, row_ids FROM changes WHERE seq > %s ORDER BY seq", (seq,)).fetchall()
            oldest = conn.execute("SELECT MIN(seq) FROM changes").fetchone()[0]
        is_complete = oldest is None or int(oldest) <= seq + 1  # else pruned past `seq`
        if not rows:
            return Changes(seq, frozenset(), is_complete)
        return Changes(int(rows[-1][0]), frozenset(int(i) for r in rows for i in r[1]), is_complete)

    def export_documents(self) -> Iterator[ExportedDocument]:
        with self._connection() as conn:
            doc_ids = [r[0] for r in conn.execute("SELECT id FROM documents ORDER BY created_at, id")]
        for doc_id in doc_ids:
            with self._connection() as conn, conn.transaction():
                row = conn.execute("SELECT * FROM documents WHERE id = %s", (doc_id,)).fetchone()
                if row is None:
                    continue
                rows = conn.execute("SELECT text, token_ids, kv_key, embedding FROM chunks WHERE document_id = %s"
                                    " ORDER BY position", (doc_id,)).fetchall()
            chunks = [NewChunk(r[0], tuple(r[1]), np.frombuffer(r[3], np.float32), r[2]) for r in rows]
            yield ExportedDocument(_document(row, []), row[5], chunks)

    @staticmethod
    def _chunks_where(conn: psycopg.Connection, where: str, params: tuple[Any, ...]) -> list[StoredChunk]:
        rows = conn.execute(
            f"SELECT {_CHUNK_COLUMNS} FROM chunks c JOIN documents d ON d.id = c.document_id"
            f" WHERE {where} ORDER BY c.document_id, c.position", params,
        ).fetchall()
        return [StoredChunk(int(r[0]), r[1], r[2], r[3], r[4], tuple(r[5]), r[6], r[7], chunk_pages(r[8], r[9]))
                for r in rows]


def _document(row: tuple, chunks: list[StoredChunk]) -> StoredDocument:
    """A `SELECT * FROM documents` row: (id, title, metadata, num_chars, created_at, content_hash)."""
    metadata = row[2] if isinstance(row[2], dict) else json.loads(row[2])
    return StoredDocument(row[0], row[1], metadata, row[3], row[4], chunks)


def _embeddings(rows: list[tuple]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    vectors = [np.frombuffer(r[1], dtype=np.float32) for r in rows]
    return ids, (np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32))


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _redacted(url: str) -> str:
    """Where the database is, without its password, for messages and logs."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "(database.url: not a valid connection string)"
    parts.pop("password", None)
    return " ".join(f"{k}={v}" for k, v in parts.items())

