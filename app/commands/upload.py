"""`ragblend ingest`'s hook for the formats the server extracts (PDF, HTML, DOCX): each file is sent
as-is to POST /v1/documents/files, one file per request, so one bad file is named and stops there."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import httpx

from app.commands.client import error_message

UPLOAD_SUFFIXES = {".pdf", ".html", ".htm", ".docx"}


class UploadFailed(Exception):
    pass


def is_upload(path: Path) -> bool:
    return path.suffix.lower() in UPLOAD_SUFFIXES


def upload_files(client: httpx.Client, paths: Sequence[Path], args: argparse.Namespace) -> tuple[int, int]:
    """(documents, chunks) ingested; raises UploadFailed with the server's message naming the file."""
    num_documents = num_chunks = 0
    form = {"precompute": str(not args.no_precompute).lower()}
    if args.chunking:
        form["chunking"] = args.chunking
    for path in paths:
        with path.open("rb") as handle:
            response = client.post("/v1/documents/files", files=[("files", (path.name, handle))], data=form)
        if response.status_code != 201:
            raise UploadFailed(f"{path}: {error_message(response)}")
        documents = response.json()["documents"]
        num_documents += len(documents)
        num_chunks += sum(len(d["chunks"]) for d in documents)
    return num_documents, num_chunks
