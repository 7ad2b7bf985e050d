"""Postgres document store, shared by server replicas (`database.url`).

The same contract as the SQLite store (one transaction per document is its commit point, row ids are
never reused), plus a change log: every commit appends one row `(seq, row ids touched)` and notifies
`CHANNEL`, so each replica's vector index follows the others' writes (retrieval/follower.py).
Sequence numbers are taken under a transaction-scoped advisory lock held to the commit, so they
become visible in commit order: a replica that has read up to `seq` never misses a smaller one.
Collections and API keys live here too, so every replica reads the same ones (a key revoked through
one replica is refused by all at their next request: keys are read per request, never cached).

The schema's version is in `ragblend_schema`; `_MIGRATIONS` is the numbered list of steps, applied at
open under an advisory lock, all in one transaction. Append new steps; never edit a released one.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import contextmanager
from typing import Any, Collection, Iterator, Sequence

import numpy as np
import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from retrieval.lexical import COMMON_TERM_SHARE, MOST_TERM_SHARE
from retrieval.store_types import (
    entry_name_hits,
    DEFAULT_COLLECTION, Changes, ChunkTokens, CollectionCounts, CollectionExistsError, CollectionNotFoundError,
    CollectionRow, DocumentStore, DocumentSummaryRow, EmbeddingBatch, ExportedDocument, FusedHit, KeyRow, NewChunk,
    PutResult, StoredChunk, StoredDocument, StoreUnavailableError, chunk_id_of, chunk_pages,
)

logger = logging.getLogger(__name__)

CHANNEL = "ragblend_changes"
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
    # Collections and API keys: every existing document lands in `default` (unsalted KV: its chunks'
    # stored keys stay valid); a document is keyed by (collection, id) from here on.
    2: f"""
    CREATE TABLE collections (
        name TEXT PRIMARY KEY,
        description TEXT NOT NULL DEFAULT '',
        created_at DOUBLE PRECISION NOT NULL,
        kv_salt TEXT NOT NULL,                                    -- part of its chunks' KV keys
        shares_kv BOOLEAN NOT NULL DEFAULT FALSE,
        kv_budget_bytes BIGINT                                    -- its own KV budget; NULL: the store's only
    );
    INSERT INTO collections (name, created_at, kv_salt)
        VALUES ('{DEFAULT_COLLECTION}', extract(epoch FROM now()), '');
    ALTER TABLE chunks DROP CONSTRAINT chunks_document_id_fkey;
    ALTER TABLE documents ADD COLUMN collection TEXT NOT NULL DEFAULT '{DEFAULT_COLLECTION}'
        REFERENCES collections(name) ON DELETE CASCADE;
    ALTER TABLE documents ALTER COLUMN collection DROP DEFAULT;
    ALTER TABLE documents DROP CONSTRAINT documents_pkey;
    ALTER TABLE documents ADD PRIMARY KEY (collection, id);
    ALTER TABLE chunks ADD COLUMN collection TEXT NOT NULL DEFAULT '{DEFAULT_COLLECTION}';
    ALTER TABLE chunks ALTER COLUMN collection DROP DEFAULT;
    ALTER TABLE chunks ADD FOREIGN KEY (collection, document_id) REFERENCES documents(collection, id)
        ON DELETE CASCADE;
    DROP INDEX chunks_by_document;
    CREATE INDEX chunks_by_document ON chunks(collection, document_id, position);
    CREATE TABLE api_keys (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL DEFAULT '',
        token_hash TEXT NOT NULL,                                 -- sha256 of the token, never the token
        role TEXT NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        revoked_at DOUBLE PRECISION
    );
    CREATE TABLE key_collections (
        key_id TEXT NOT NULL REFERENCES api_keys(id) ON DELETE CASCADE,
        collection TEXT NOT NULL REFERENCES collections(name) ON DELETE CASCADE,
        PRIMARY KEY (key_id, collection)
    );
    """,
    # The chunks' full-text index: a stored generated column (so every write fills it in the chunk's own
    # row, in the chunk's transaction, and ALTER TABLE backfills the rows already there) and its GIN
    # index. English stemming and stop words, as the SQLite store's FTS5 (Porter) and query.
    3: LEXICAL_INDEX_SQL,
}
SCHEMA_VERSION = max(_MIGRATIONS)

_LEXICAL_SEARCH = """
WITH stats AS (
    SELECT most_common_elems::text::text[] AS elems, most_common_elem_freqs AS freqs
    FROM pg_stats WHERE schemaname = current_schema() AND tablename = 'chunks' AND attname = 'text_tsv'),
common AS (
    SELECT e.elem, e.freq FROM stats, unnest(stats.elems, stats.freqs[1:array_length(stats.elems, 1)]) AS e(elem, freq)
    WHERE e.freq > %(common)s),
asked AS (SELECT DISTINCT unnest(tsvector_to_array(to_tsvector('english', %(question)s))) AS term),
rare AS (SELECT term FROM asked WHERE term NOT IN (SELECT elem FROM common)),
usual AS (SELECT term FROM asked WHERE term NOT IN (SELECT elem FROM common WHERE freq > %(most)s)),
terms AS (SELECT term FROM rare
          UNION ALL SELECT term FROM usual WHERE NOT EXISTS (SELECT 1 FROM rare)
          UNION ALL SELECT term FROM asked WHERE NOT EXISTS (SELECT 1 FROM rare) AND NOT EXISTS (SELECT 1 FROM usual)),
hits AS MATERIALIZED (
    SELECT t.term, c.row_id FROM terms t JOIN chunks c ON c.text_tsv @@ quote_literal(t.term)::tsquery
    WHERE c.collection = ANY(%(collections)s)),
df AS (SELECT term, count(*)::float8 AS n FROM hits GROUP BY term),
total AS (SELECT GREATEST((SELECT reltuples::float8 FROM pg_class WHERE oid = 'chunks'::regclass),
                          (SELECT max(n) FROM df)) AS n)
SELECT h.row_id, sum(ln((total.n - df.n + 0.5) / (df.n + 0.5) + 1.0)) AS score
FROM hits h JOIN df USING (term), total
GROUP BY h.row_id ORDER BY score DESC, h.row_id LIMIT %(limit)s
"""
_MISSING_WORDS = """
SELECT w FROM unnest(%(words)s::text[]) AS w
WHERE numnode(plainto_tsquery('english', w)) > 0
  AND NOT EXISTS (SELECT 1 FROM chunks c WHERE c.collection = ANY(%(collections)s)
                  AND c.text_tsv @@ plainto_tsquery('english', w))
"""
# `name_hits`: each name's first chunks (at most limit + 1 read: one more leaves the name out), its words as a
# phrase of the tsvector (phraseto_tsquery: in order, adjacent); a name the parser leaves nothing of matches none
_NAME_HITS = """
SELECT n.name, h.row_id, h.document_id, d.title FROM unnest(%(names)s::text[]) AS n(name)
CROSS JOIN LATERAL (SELECT c.row_id, c.collection, c.document_id FROM chunks c WHERE c.collection = ANY(%(collections)s)
                    AND c.text_tsv @@ phraseto_tsquery('english', n.name) LIMIT %(over)s) AS h
JOIN documents d ON d.collection = h.collection AND d.id = h.document_id
WHERE numnode(phraseto_tsquery('english', n.name)) > 0
"""

# an uploaded PDF's pages per chunk (metadata.chunk_pages / chunk_last_pages, by position)
_CHUNK_COLUMNS = ("c.row_id, c.id, c.document_id, c.position, c.text, c.token_ids, c.kv_key, d.title,"
                  " d.metadata->'chunk_pages'->c.position, d.metadata->'chunk_last_pages'->c.position, c.collection")
_DOCUMENT_COLUMNS = "id, title, metadata, num_chars, created_at, content_hash, collection"
_JOIN = "chunks c JOIN documents d ON d.collection = c.collection AND d.id = c.document_id"
# Hybrid's rows in one round trip (retrieval.store_types.rows_of_ranking's result, as one statement): the
# ranked chunks' rows, with the embeddings of those the dense ranking did not hold.
_FUSED_ROWS_SQL = (f"SELECT CASE WHEN c.row_id = ANY(%(dense)s::bigint[]) THEN NULL ELSE c.embedding END, {_CHUNK_COLUMNS}"
                   f" FROM {_JOIN} WHERE c.row_id = ANY(%(ranked)s::bigint[])")


class PostgresDocumentStore(DocumentStore):
    """A connection pool (psycopg_pool); each call borrows one connection. Any connection failure is
    raised as StoreUnavailableError (the API answers 503): the failed call wrote nothing.

    Connections are in autocommit: a read is the pool's liveness check and the query, two round trips
    instead of four (BEGIN before the query, COMMIT when the pool takes the connection back): a search's
    full-text query and chunk rows p50 4.2 -> 3.6 ms, p99 10.9 -> 7.8 ms at 10 000 chunks
    (docs/benchmarks/retrieval.md). Every write of more than one
    statement is in its own `conn.transaction()`; a one-statement write commits alone either way."""

    is_shared = True

    def __init__(self, url: str, max_connections: int = 8, timeout_s: float = 5.0):
        self.url, self.timeout_s = url, timeout_s
        self._pool = ConnectionPool(
            url, min_size=1, max_size=max_connections, timeout=timeout_s, open=False,
            check=ConnectionPool.check_connection,  # a connection dropped by a server restart is replaced
            kwargs={"connect_timeout": max(1, int(timeout_s)), "autocommit": True}, name="ragblend-store",
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

    # --- documents ---------------------------------------------------------------------------------
    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk],
        content_hash: str | None = None, collection: str = DEFAULT_COLLECTION,
    ) -> PutResult:
        where = ("c.collection = %s AND c.document_id = %s", (collection, doc_id))
        with self._connection() as conn, conn.transaction():
            # One writer per document at a time: two replicas writing the same document serialize here,
            # and the second sees the first's content hash.
            _lock_document(conn, collection, doc_id)
            # FOR KEY SHARE: a concurrent delete of the collection waits for this commit (or this
            # insert waits for the delete's and finds no collection)
            if conn.execute("SELECT 1 FROM collections WHERE name = %s FOR KEY SHARE", (collection,)).fetchone() is None:
                raise CollectionNotFoundError(f"collection not found: {collection}")
            row = _document_row(conn, collection, doc_id)
            if content_hash is not None and row is not None and row[5] == content_hash:
                return PutResult(_document(row, self._chunks_where(conn, *where)), [], True)
            replaced = self._chunks_where(conn, *where)
            conn.execute("DELETE FROM documents WHERE collection = %s AND id = %s", (collection, doc_id))
            now = time.time()
            conn.execute(
                f"INSERT INTO documents ({_DOCUMENT_COLUMNS}) VALUES (%s, %s, %s, %s, %s, %s, %s)",
                (doc_id, title, json.dumps(metadata), num_chars, now, content_hash, collection),
            )
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO chunks (id, collection, document_id, position, text, token_ids, kv_key, embedding)"
                    " VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    [(chunk_id_of(collection, doc_id, position), collection, doc_id, position, chunk.text,
                      list(chunk.token_ids), chunk.kv_key, np.asarray(chunk.embedding, dtype=np.float32).tobytes())
                     for position, chunk in enumerate(chunks)],
                )
            stored = self._chunks_where(conn, *where)
            self._log_change(conn, doc_id, [c.row_id for c in replaced] + [c.row_id for c in stored])
        return PutResult(StoredDocument(doc_id, title, metadata, num_chars, now, stored, collection), replaced)

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

    def delete_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> list[StoredChunk] | None:
        with self._connection() as conn, conn.transaction():
            _lock_document(conn, collection, doc_id)
            if _document_row(conn, collection, doc_id) is None:
                return None
            chunks = self._chunks_where(conn, "c.collection = %s AND c.document_id = %s", (collection, doc_id))
            conn.execute("DELETE FROM documents WHERE collection = %s AND id = %s", (collection, doc_id))
            self._log_change(conn, doc_id, [c.row_id for c in chunks])
        return chunks

    def get_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> StoredDocument | None:
        with self._connection() as conn, conn.transaction():  # one snapshot: the document and its chunks agree
            row = _document_row(conn, collection, doc_id)
            if row is None:
                return None
            return _document(row, self._chunks_where(conn, "c.collection = %s AND c.document_id = %s",
                                                     (collection, doc_id)))

    def content_hash(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> str | None:
        with self._connection() as conn:
            row = conn.execute("SELECT content_hash FROM documents WHERE collection = %s AND id = %s",
                               (collection, doc_id)).fetchone()
        return None if row is None else row[0]

    def list_documents(self, limit: int = 100, offset: int = 0,
                       collections: Sequence[str] = (DEFAULT_COLLECTION,)) -> list[DocumentSummaryRow]:
        with self._connection() as conn:
            rows = conn.execute(
                "SELECT d.id, d.title, d.num_chars, d.created_at,"
                " (SELECT COUNT(*) FROM chunks c WHERE c.collection = d.collection AND c.document_id = d.id)"
                " AS num_chunks, d.collection FROM documents d WHERE d.collection = ANY(%s)"
                " ORDER BY d.created_at, d.collection, d.id LIMIT %s OFFSET %s", (list(collections), limit, offset)
            ).fetchall()
        return [DocumentSummaryRow(r[0], r[1], int(r[4]), r[2], r[3], r[5]) for r in rows]

    def collections_of_document(self, doc_id: str, collections: Sequence[str]) -> list[str]:
        with self._connection() as conn:
            return [r[0] for r in conn.execute("SELECT collection FROM documents WHERE id = %s AND"
                                               " collection = ANY(%s) ORDER BY collection", (doc_id, list(collections)))]

    def chunks_by_row_ids(self, row_ids: Sequence[int]) -> dict[int, StoredChunk]:
        if not row_ids:
            return {}
        with self._connection() as conn:
            chunks = self._chunks_where(conn, "c.row_id = ANY(%s)", ([int(i) for i in row_ids],))
        return {c.row_id: c for c in chunks}

    def chunks_by_ids(self, chunk_ids: Sequence[str], collections: Sequence[str] | None = None) -> dict[str, StoredChunk]:
        if not chunk_ids:
            return {}
        where, params = "c.id = ANY(%s)", (list(chunk_ids),)
        if collections is not None:
            where, params = where + " AND c.collection = ANY(%s)", (*params, list(collections))
        with self._connection() as conn:
            chunks = self._chunks_where(conn, where, params)
        return {c.id: c for c in chunks}

    def lexical_search(self, question: str, limit: int, collections: Sequence[str]) -> list[tuple[int, float]]:
        """(row id, score: higher is better) of `collections`' chunks holding any of the question's words
        (English stems, stop words left out), best first. Postgres's own rankings (ts_rank, ts_rank_cd) weigh a
        word by its count in the chunk, not by its rarity, and cost a pass over every matching chunk's
        tsvector: so each chunk scores the sum of its matched words' inverse document frequencies (BM25's
        idf, from the matches themselves), and words in over COMMON_TERM_SHARE of the chunks (by the
        column's statistics) are left out of the match unless nothing else is left, then those in over
        MOST_TERM_SHARE (they weigh little and would match thousands of chunks:
        docs/design/retrieval.md#lexical)."""
        with self._connection() as conn:
            rows = conn.execute(_LEXICAL_SEARCH, {"question": question, "common": COMMON_TERM_SHARE,
                                                  "most": MOST_TERM_SHARE, "limit": limit,
                                                  "collections": list(collections)}).fetchall()
        return [(int(r[0]), float(r[1])) for r in rows]

    def missing_words(self, words: Sequence[str], collections: Sequence[str]) -> list[str]:
        """The `words` no chunk of `collections` holds, by the tsvector index (English stems; a stop word,
        which the index drops, counts as held), in one statement."""
        if not words:
            return []
        with self._connection() as conn:
            missing = {r[0] for r in conn.execute(_MISSING_WORDS, {"words": list(words),
                                                                   "collections": list(collections)}).fetchall()}
        return [w for w in words if w in missing]

    def name_hits(self, names: Sequence[str], limit: int, collections: Sequence[str]) -> dict[str, list[int]]:
        """All names in one statement (one round trip)."""
        if not names or not collections or limit < 1:
            return {}
        with self._connection() as conn:
            rows = conn.execute(_NAME_HITS, {"names": list(names), "collections": list(collections),
                                             "over": limit + 1}).fetchall()
        found: dict[str, list[tuple[int, str, str | None]]] = {}
        for name, row_id, document_id, title in rows:
            found.setdefault(name, []).append((int(row_id), document_id, title))
        return entry_name_hits(names, found, limit)

    def fused_rows(self, ranked: Sequence[tuple[int, float]], dense: Collection[int]) -> list[FusedHit]:
        """`rows_of_ranking`'s result in one statement: the rows and the lexical-only hits' embeddings in
        one round trip instead of two."""
        if not ranked:
            return []
        with self._connection() as conn:
            rows = conn.execute(_FUSED_ROWS_SQL, {"dense": [int(i) for i in dense],
                                                  "ranked": [int(i) for i, _ in ranked]}).fetchall()
        found = {int(r[1]): r for r in rows}
        return [FusedHit(_chunk(found[row_id][1:]), score, None if found[row_id][0] is None
                         else np.frombuffer(found[row_id][0], dtype=np.float32))
                for row_id, score in ranked if row_id in found]

    def iter_chunks(self, batch_size: int = 1024) -> Iterator[list[StoredChunk]]:
        last = 0
        while True:  # keyset pages: no connection is held between batches
            with self._connection() as conn:
                chunks = self._chunks_where(conn, "c.row_id IN (SELECT row_id FROM chunks WHERE row_id > %s"
                                            " ORDER BY row_id LIMIT %s)", (last, batch_size))
            if not chunks:
                return
            chunks.sort(key=lambda c: c.row_id)
            last = chunks[-1].row_id
            yield chunks

    def set_chunk_embeddings(self, row_ids: Sequence[int], vectors: np.ndarray) -> None:
        rows = [(np.asarray(v, dtype=np.float32).tobytes(), int(i)) for i, v in zip(row_ids, vectors)]
        with self._connection() as conn, conn.transaction(), conn.cursor() as cursor:
            cursor.executemany("UPDATE chunks SET embedding = %s WHERE row_id = %s", rows)

    def set_chunk_tokens(self, updates: Sequence[ChunkTokens]) -> None:
        with self._connection() as conn, conn.transaction(), conn.cursor() as cursor:
            cursor.executemany("UPDATE chunks SET token_ids = %s, kv_key = %s WHERE id = %s",
                               [(list(u.token_ids), u.kv_key, u.chunk_id) for u in updates])

    def is_kv_key_used(self, kv_key: str) -> bool:
        return self.collection_of_kv_key(kv_key) is not None

    def collection_of_kv_key(self, kv_key: str) -> str | None:
        with self._connection() as conn:
            row = conn.execute("SELECT collection FROM chunks WHERE kv_key = %s LIMIT 1", (kv_key,)).fetchone()
        return None if row is None else row[0]

    def num_documents(self, collections: Sequence[str] | None = None) -> int:
        where, params = _in_collections(collections)
        with self._connection() as conn:
            return int(conn.execute(f"SELECT COUNT(*) FROM documents{where}", params).fetchone()[0])

    def num_chunks(self, collections: Sequence[str] | None = None) -> int:
        where, params = _in_collections(collections)
        with self._connection() as conn:
            return int(conn.execute(f"SELECT COUNT(*) FROM chunks{where}", params).fetchone()[0])

    def row_ids(self) -> set[int]:
        with self._connection() as conn:
            return {int(r[0]) for r in conn.execute("SELECT row_id FROM chunks")}

    def kv_keys(self, collections: Sequence[str] | None = None) -> set[str]:
        where, params = _in_collections(collections)
        where = f"{where} AND kv_key IS NOT NULL" if where else " WHERE kv_key IS NOT NULL"
        with self._connection() as conn:
            return {r[0] for r in conn.execute(f"SELECT DISTINCT kv_key FROM chunks{where}", params)}

    def kv_keys_by_document(self, doc_ids: Sequence[str],
                            collection: str = DEFAULT_COLLECTION) -> dict[str, list[str | None]]:
        out: dict[str, list[str | None]] = {doc_id: [] for doc_id in doc_ids}
        with self._connection() as conn:
            for doc_id, kv_key in conn.execute(
                    "SELECT document_id, kv_key FROM chunks WHERE collection = %s AND document_id = ANY(%s)"
                    " ORDER BY document_id, position", (collection, list(doc_ids))):
                out[doc_id].append(kv_key)
        return out

    def num_chunk_tokens(self, collections: Sequence[str] | None = None) -> int:
        where, params = _in_collections(collections)
        with self._connection() as conn:
            return int(conn.execute(f"SELECT COALESCE(SUM(cardinality(token_ids)), 0) FROM chunks{where}",
                                    params).fetchone()[0])

    def embeddings_of(self, row_ids: Sequence[int]) -> EmbeddingBatch:
        with self._connection() as conn:
            rows = conn.execute("SELECT row_id, embedding, collection FROM chunks WHERE row_id = ANY(%s)"
                                " ORDER BY row_id", ([int(i) for i in row_ids],)).fetchall()
        return _embeddings(rows)

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[EmbeddingBatch]:
        last = 0
        while True:  # keyset pages: no connection is held between batches
            with self._connection() as conn:
                rows = conn.execute("SELECT row_id, embedding, collection FROM chunks WHERE row_id > %s"
                                    " ORDER BY row_id LIMIT %s", (last, batch_size)).fetchall()
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
            keys = [(r[0], r[1]) for r in conn.execute(
                "SELECT collection, id FROM documents ORDER BY created_at, collection, id")]
        for collection, doc_id in keys:
            with self._connection() as conn, conn.transaction():
                row = _document_row(conn, collection, doc_id)
                if row is None:
                    continue
                rows = conn.execute("SELECT text, token_ids, kv_key, embedding FROM chunks WHERE collection = %s"
                                    " AND document_id = %s ORDER BY position", (collection, doc_id)).fetchall()
            chunks = [NewChunk(r[0], tuple(r[1]), np.frombuffer(r[3], np.float32), r[2]) for r in rows]
            yield ExportedDocument(_document(row, []), row[5], chunks)

    # --- collections -------------------------------------------------------------------------------
    def create_collection(self, row: CollectionRow) -> CollectionRow:
        with self._connection() as conn:
            try:
                conn.execute(
                    "INSERT INTO collections (name, description, created_at, kv_salt, shares_kv, kv_budget_bytes)"
                    " VALUES (%s, %s, %s, %s, %s, %s)",
                    (row.name, row.description, row.created_at, row.kv_salt, row.shares_kv, row.kv_budget_bytes))
            except psycopg.errors.UniqueViolation:
                raise CollectionExistsError(f"collection exists: {row.name}") from None
        return row

    def get_collection(self, name: str) -> CollectionRow | None:
        with self._connection() as conn:
            row = conn.execute(f"SELECT {_COLLECTION_COLUMNS} FROM collections WHERE name = %s", (name,)).fetchone()
        return None if row is None else CollectionRow(*row)

    def list_collections(self) -> list[CollectionRow]:
        with self._connection() as conn:
            return [CollectionRow(*r) for r in conn.execute(
                f"SELECT {_COLLECTION_COLUMNS} FROM collections ORDER BY name")]

    def update_collection(self, row: CollectionRow) -> bool:
        with self._connection() as conn:
            cursor = conn.execute("UPDATE collections SET description = %s, kv_budget_bytes = %s WHERE name = %s",
                                  (row.description, row.kv_budget_bytes, row.name))
        return cursor.rowcount > 0

    def delete_collection(self, name: str) -> list[StoredChunk] | None:
        with self._connection() as conn, conn.transaction():
            # FOR UPDATE waits for writes into it (they hold FOR KEY SHARE) and holds off new ones
            if conn.execute("SELECT 1 FROM collections WHERE name = %s FOR UPDATE", (name,)).fetchone() is None:
                return None
            chunks = self._chunks_where(conn, "c.collection = %s", (name,))
            # documents, chunks and key grants go with it (ON DELETE CASCADE), in this transaction
            conn.execute("DELETE FROM collections WHERE name = %s", (name,))
            self._log_change(conn, f"collection:{name}", [c.row_id for c in chunks])
        return chunks

    def collection_counts(self, names: Sequence[str]) -> dict[str, CollectionCounts]:
        with self._connection() as conn:
            documents = dict(conn.execute("SELECT collection, COUNT(*) FROM documents WHERE collection = ANY(%s)"
                                          " GROUP BY collection", (list(names),)).fetchall())
            chunks = {r[0]: (int(r[1]), int(r[2])) for r in conn.execute(
                "SELECT collection, COUNT(*), COALESCE(SUM(cardinality(token_ids)), 0) FROM chunks"
                " WHERE collection = ANY(%s) GROUP BY collection", (list(names),))}
        return {name: CollectionCounts(int(documents.get(name, 0)), *chunks.get(name, (0, 0))) for name in names}

    # --- API keys ----------------------------------------------------------------------------------
    def create_key(self, row: KeyRow) -> KeyRow:
        with self._connection() as conn, conn.transaction():
            found = {r[0] for r in conn.execute("SELECT name FROM collections WHERE name = ANY(%s) FOR KEY SHARE",
                                                (list(row.collections),))}
            missing = sorted(set(row.collections) - found)
            if missing:
                raise CollectionNotFoundError(f"collection not found: {missing[0]}")
            try:
                conn.execute("INSERT INTO api_keys (id, name, token_hash, role, created_at, revoked_at)"
                             " VALUES (%s, %s, %s, %s, %s, %s)",
                             (row.id, row.name, row.token_hash, row.role, row.created_at, row.revoked_at))
            except psycopg.errors.UniqueViolation:
                raise CollectionExistsError(f"key id exists: {row.id}") from None
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO key_collections (key_id, collection) VALUES (%s, %s)",
                                [(row.id, name) for name in sorted(set(row.collections))])
        return row

    def get_key(self, key_id: str) -> KeyRow | None:
        with self._connection() as conn:
            row = conn.execute(
                f"SELECT {_KEY_COLUMNS}, ARRAY(SELECT collection FROM key_collections g WHERE g.key_id = k.id"
                " ORDER BY collection) FROM api_keys k WHERE k.id = %s", (key_id,)).fetchone()
        return None if row is None else _key(row)

    def list_keys(self) -> list[KeyRow]:
        with self._connection() as conn:
            return [_key(r) for r in conn.execute(
                f"SELECT {_KEY_COLUMNS}, ARRAY(SELECT collection FROM key_collections g WHERE g.key_id = k.id"
                " ORDER BY collection) FROM api_keys k ORDER BY k.created_at, k.id")]

    def has_live_keys(self) -> bool:
        with self._connection() as conn:
            return conn.execute("SELECT 1 FROM api_keys WHERE revoked_at IS NULL LIMIT 1").fetchone() is not None

    def revoke_key(self, key_id: str, revoked_at: float) -> bool:
        with self._connection() as conn:
            cursor = conn.execute("UPDATE api_keys SET revoked_at = %s WHERE id = %s AND revoked_at IS NULL",
                                  (revoked_at, key_id))
        return cursor.rowcount > 0

    @staticmethod
    def _chunks_where(conn: psycopg.Connection, where: str, params: tuple[Any, ...]) -> list[StoredChunk]:
        rows = conn.execute(
            f"SELECT {_CHUNK_COLUMNS} FROM {_JOIN} WHERE {where} ORDER BY c.collection, c.document_id, c.position",
            params,
        ).fetchall()
        return [_chunk(r) for r in rows]


def _chunk(r: Sequence[Any]) -> StoredChunk:
    """A chunk from a row of _CHUNK_COLUMNS."""
    return StoredChunk(int(r[0]), r[1], r[2], r[3], r[4], tuple(r[5]), r[6], r[7], chunk_pages(r[8], r[9]), r[10])


_COLLECTION_COLUMNS = "name, description, created_at, kv_salt, shares_kv, kv_budget_bytes"
_KEY_COLUMNS = "k.id, k.name, k.token_hash, k.role, k.created_at, k.revoked_at"


def _lock_document(conn: psycopg.Connection, collection: str, doc_id: str) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"{collection}/{doc_id}",))


def _document_row(conn: psycopg.Connection, collection: str, doc_id: str) -> tuple | None:
    return conn.execute(f"SELECT {_DOCUMENT_COLUMNS} FROM documents WHERE collection = %s AND id = %s",
                        (collection, doc_id)).fetchone()


def _in_collections(collections: Sequence[str] | None) -> tuple[str, tuple[Any, ...]]:
    """A WHERE clause limiting `collection` to `collections` (none: every collection), and its parameters."""
    return ("", ()) if collections is None else (" WHERE collection = ANY(%s)", (list(collections),))


def _document(row: tuple, chunks: list[StoredChunk]) -> StoredDocument:
    """A `SELECT _DOCUMENT_COLUMNS` row: (id, title, metadata, num_chars, created_at, content_hash, collection)."""
    metadata = row[2] if isinstance(row[2], dict) else json.loads(row[2])
    return StoredDocument(row[0], row[1], metadata, row[3], row[4], chunks, row[6])


def _key(row: tuple) -> KeyRow:
    return KeyRow(row[0], row[1], row[2], row[3], tuple(row[6]), row[4], row[5])


def _embeddings(rows: list[tuple]) -> EmbeddingBatch:
    ids = np.array([r[0] for r in rows], dtype=np.int64)
    vectors = [np.frombuffer(r[1], dtype=np.float32) for r in rows]
    return EmbeddingBatch(ids, np.stack(vectors) if vectors else np.zeros((0, 0), dtype=np.float32),
                          tuple(r[2] for r in rows))


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

