"""A Postgres database a bench writes its store into (`--database-url`): emptied first, settled after a fill."""

from __future__ import annotations


def settle(url: str) -> None:
    """VACUUM ANALYZE after the fill: the steady state autovacuum keeps a written table in (its
    statistics are what the full-text search's common words come from), rather than autovacuum's
    first pass over 10 000 new rows running during the measurement."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


def empty_database(url: str) -> None:
    """Drop ragblend's tables: each configuration starts from an empty store."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS changes, chunks, documents, collections, key_collections, api_keys,"
                     " ragblend_schema CASCADE")
