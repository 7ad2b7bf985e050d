"""`ragblend ingest`'s hook for the formats the server extracts (PDF, HTML, DOCX): each file is sent
as-is to POST /v1/documents/files, one file per request, so one bad file is named and stops there."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import NamedTuple, Sequence

import httpx

from app.commands.client import error_message

UPLOAD_SUFFIXES = {".pdf", ".html", ".htm", ".docx"}


class UploadFailed(Exception):
    pass


class Upload(NamedTuple):
    path: Path
    doc_id: str  # sent as the form's `ids`: the server would otherwise use the base name alone


def is_upload(path: Path) -> bool:
    return path.suffix.lower() in UPLOAD_SUFFIXES


def shown_name(path: Path) -> str:
    """The file's name as UTF-8 (a non-UTF-8 byte becomes \\xNN: the id, sent apart, stays exact)."""
    return os.fsencode(path.name).decode("utf-8", "backslashreplace")


def upload_files(client: httpx.Client, uploads: Sequence[Upload], args: argparse.Namespace) -> tuple[int, int]:
    """(documents, chunks) ingested; raises UploadFailed with the server's message naming the file."""
    num_documents = num_chunks = 0
    form = {"precompute": str(not args.no_precompute).lower()}
    if args.chunking:
        form["chunking"] = args.chunking
    if args.collection:
        form["collection"] = args.collection
    for path, doc_id in uploads:
        with path.open("rb") as handle:
            response = client.post("/v1/documents/files", files=[("files", (shown_name(path), handle))],
                                   data={**form, "ids": doc_id})
        if response.status_code != 201:
            raise UploadFailed(f"{path}: {error_message(response)}")
        documents = response.json()["documents"]
        num_documents += len(documents)
        num_chunks += sum(len(d["chunks"]) for d in documents)
    return num_documents, num_chunks
