"""`ragblend ingest PATH...`: post txt, md and jsonl files to a running server, with a progress bar;
PDF, HTML and DOCX files go to POST /v1/documents/files (the server extracts their text).

Files are read by app.commands.ingest_files (ids from the path relative to the argument, empty files
skipped with a warning). Bad input is reported, one line per problem, before anything is sent.
Exit codes: app.commands.exit_codes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.commands.client import add_client_arguments, error_message, make_client
from app.commands.exit_codes import ExitCode
from app.commands.ingest_files import READERS, collect
from app.commands.upload import UploadFailed, upload_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path,
                        help=f"files or directories (searched for {', '.join(sorted(READERS))})")
    parser.add_argument("--chunking", choices=["tokens", "structure", "none"], help="default from the server's config")
    parser.add_argument("--no-precompute", action="store_true", help="do not precompute chunk KV at ingestion")
    parser.add_argument("--batch-size", type=int, default=8, help="documents per request")
    parser.add_argument("--collection", help="the knowledge base they go into (default: `default`; a key bound to "
                        "one collection: that one)")
    add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    if args.batch_size < 1:
        print("ragblend ingest: --batch-size must be >= 1", file=sys.stderr)
        return ExitCode.USAGE
    collected = collect(args.paths)
    for warning in collected.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    for error in collected.errors:
        print(f"error: {error}", file=sys.stderr)
    if collected.errors:
        print(f"nothing ingested: {len(collected.errors)} input error(s)", file=sys.stderr)
        return ExitCode.USAGE
    documents, uploads = collected.documents, collected.uploads
    if not documents and not uploads:
        print("nothing to ingest: no non-empty documents found", file=sys.stderr)
        return ExitCode.USAGE
    num_done, num_chunks = 0, 0
    with make_client(args) as client, tqdm(total=len(documents), unit="doc", desc="ingest") as bar:
        for start in range(0, len(documents), args.batch_size):
            batch = documents[start : start + args.batch_size]
            body: dict = {"documents": batch, "precompute": not args.no_precompute}
            if args.chunking:
                body["chunking"] = args.chunking
            if args.collection:
                body["collection"] = args.collection
            response = client.post("/v1/documents", json=body)
            if response.status_code != 201:
                bar.close()
                print(f"error: batch of {_describe(batch)}: {error_message(response)}", file=sys.stderr)
                print(f"{num_done} of {len(documents)} documents ingested before the error", file=sys.stderr)
                return ExitCode.FAILED
            num_chunks += sum(len(d["chunks"]) for d in response.json()["documents"])
            num_done += len(batch)
            bar.update(len(batch))
        try:
            num_uploaded, num_upload_chunks = upload_files(client, uploads, args)
        except UploadFailed as exc:
            bar.close()
            print(f"error: {exc}", file=sys.stderr)
            print(f"{num_done} of {len(documents)} documents ingested before the error", file=sys.stderr)
            return ExitCode.FAILED
    print(f"ingested {num_done + num_uploaded} documents, {num_chunks + num_upload_chunks} chunks")
    return ExitCode.OK


def _describe(batch: list[dict]) -> str:
    """The batch's files (or ids), for an error line."""
    names = []
    for doc in batch:
        metadata = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
        names.append(str(metadata.get("source") or doc.get("id") or "(no id)"))
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
