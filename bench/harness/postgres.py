"""A Postgres database a bench writes its store into (`--database-url`): emptied first, settled after a fill."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from retrieval.pg_store import PostgresDocumentStore


def settle(url: str) -> None:
    """VACUUM ANALYZE after the fill: the steady state autovacuum keeps a written table in (its
    statistics are what the full-text search's common words come from), rather than autovacuum's
    first pass over 10 000 new rows running during the measurement."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def empty_store(url: str | None) -> PostgresDocumentStore | None:
    """A document store in the database at `url`, ragblend's tables dropped first: each configuration starts
    from an empty store. None without a URL (the retriever's own SQLite)."""
    if url is None:
        return None
    import psycopg

    from retrieval.pg_store import PostgresDocumentStore

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS changes, chunks, documents, collections, key_collections, api_keys,"
                     " ragblend_schema CASCADE")
    return PostgresDocumentStore(url)
