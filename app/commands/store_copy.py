"""`ragblend store copy`: move an existing install onto the shared store. Copies a data directory's
SQLite store into Postgres: its collections (with their KV salts, so their chunks' KV keys stay valid),
every document (chunks, token ids, KV keys, embeddings, content hashes; one transaction per document)
and its API keys (hashes only), so an interrupted copy is re-run safely (a document already there with
the same content is left as it is; a collection or key already there is kept). KV entries stay where they are: their keys
are content-addressed, so a replica finds them in a shared tier, or recomputes a missing one on its
first miss (self-healing). Each replica's vector index is built from Postgres when it starts."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

from app.commands.exit_codes import ExitCode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, required=True,
                        help="the data directory whose documents.sqlite3 is copied (read only)")
    parser.add_argument("--database-url", default=os.environ.get("RAGBLEND_DATABASE__URL"),
                        help="postgresql://... to copy into (default: $RAGBLEND_DATABASE__URL)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a document already in Postgres whose content differs (default: keep it, "
                             "report it, exit 1)")


def run(args: argparse.Namespace) -> int:
    from retrieval.doc_store import SqliteDocumentStore
    from retrieval.pg_store import PostgresDocumentStore
    from retrieval.store_types import CollectionExistsError, StoreUnavailableError

    source_path = args.data_dir / "documents.sqlite3"
    if not source_path.is_file():
        print(f"ragblend store copy: no document store at {source_path}", file=sys.stderr)
        return ExitCode.USAGE
    if not args.database_url:
        print("ragblend store copy: give --database-url (or set RAGBLEND_DATABASE__URL)", file=sys.stderr)
        return ExitCode.USAGE
    source = SqliteDocumentStore(source_path)
    try:
        target = PostgresDocumentStore(args.database_url)
    except StoreUnavailableError as exc:
        source.close()
        print(f"ragblend store copy: {exc}", file=sys.stderr)
        return ExitCode.UNREACHABLE
    counts: Counter[str] = Counter()
    conflicts: list[str] = []
    try:
        for row in source.list_collections():
            existing = target.get_collection(row.name)
            if existing is None:
                target.create_collection(row)
            elif existing.kv_salt != row.kv_salt:
                print(f"ragblend store copy: collection {row.name} exists in Postgres with another KV salt; "
                      "its chunks' KV will be recomputed there", file=sys.stderr)
        for exported in source.export_documents():
            doc = exported.document
            stored_hash = target.content_hash(doc.id, doc.collection)
            is_present = stored_hash is not None or target.get_document(doc.id, doc.collection) is not None
            if is_present and stored_hash != exported.content_hash and not args.overwrite:
                conflicts.append(doc.id if doc.collection == "default" else f"{doc.collection}/{doc.id}")
                continue
            result = target.put_document(doc.id, doc.title, doc.metadata, doc.num_chars, exported.chunks,
                                         exported.content_hash, doc.collection)
            counts["unchanged" if result.is_unchanged else "replaced" if result.replaced else "copied"] += 1
            counts["chunks"] += 0 if result.is_unchanged else len(exported.chunks)
        for key in source.list_keys():
            try:
                target.create_key(key)  # revoked ones stay revoked (revoked_at is copied)
                counts["keys"] += 1
            except CollectionExistsError:  # copied by an earlier run
                pass
    except StoreUnavailableError as exc:
        print(f"ragblend store copy: {exc} (after {counts['copied']} documents; re-running is safe)", file=sys.stderr)
        return ExitCode.UNREACHABLE
    finally:
        source.close()
        target.close()
    print(f"copied {counts['copied']} documents ({counts['chunks']} chunks), replaced {counts['replaced']}, "
          f"unchanged {counts['unchanged']}, kept {len(conflicts)} that differ; {counts['keys']} API keys")
    for doc_id in conflicts:
        print(f"  kept (differs; --overwrite replaces it): {doc_id}")
    return ExitCode.FAILED if conflicts else ExitCode.OK
