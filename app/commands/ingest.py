"""`ragblend ingest PATH...`: post txt, md and jsonl files to a running server, with a progress bar;
PDF, HTML and DOCX files go to POST /v1/documents/files (the server extracts their text).

A .txt/.md file is one document (id from the file name, title from the first heading or line).
A .jsonl file holds one document per line: {"id"?, "title"?, "text", "metadata"?}.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Iterator

from app.commands.client import add_client_arguments, error_message, make_client
from app.commands.upload import UPLOAD_SUFFIXES, UploadFailed, is_upload, upload_files

SUFFIXES = {".txt", ".md", ".markdown", ".jsonl"} | UPLOAD_SUFFIXES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="files or directories (searched for txt, md, jsonl, pdf, html, docx)")
    parser.add_argument("--chunking", choices=["tokens", "none"], help="default from the server's config")
    parser.add_argument("--no-precompute", action="store_true", help="do not precompute chunk KV at ingestion")
    parser.add_argument("--batch-size", type=int, default=8, help="documents per request")
    add_client_arguments(parser)


def iter_files(paths: list[Path]) -> Iterator[Path]:
    for path in paths:
        if path.is_dir():
            yield from sorted(p for p in path.rglob("*") if p.suffix.lower() in SUFFIXES and p.is_file())
        elif path.is_file():
            yield path
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")


def documents_of(path: Path) -> Iterator[dict]:
    if path.suffix.lower() == ".jsonl":
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                doc = json.loads(line)
                if not isinstance(doc, dict) or "text" not in doc:
                    raise ValueError(f"{path}:{number}: each line must be an object with 'text'")
                yield doc
        return
    text = path.read_text(encoding="utf-8")
    first = next((line for line in text.splitlines() if line.strip()), path.stem)
    yield {"id": _doc_id(path), "title": first.lstrip("# ").strip()[:200], "text": text,
           "metadata": {"source": str(path)}}


def _doc_id(path: Path) -> str:
    return re.sub(r"[^A-Za-z0-9._:-]", "-", path.stem).lstrip("._:-")[:128] or "doc"


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    paths = list(iter_files(args.paths))
    uploads = [path for path in paths if is_upload(path)]  # PDF, HTML, DOCX: extracted by the server
    documents = [doc for path in paths if not is_upload(path) for doc in documents_of(path)]
    if not documents and not uploads:
        print("no documents found", file=sys.stderr)
        return 1
    num_chunks = 0
    with make_client(args) as client, tqdm(total=len(documents), unit="doc", desc="ingest") as bar:
        for start in range(0, len(documents), args.batch_size):
            body: dict = {"documents": documents[start : start + args.batch_size],
                          "precompute": not args.no_precompute}
            if args.chunking:
                body["chunking"] = args.chunking
            response = client.post("/v1/documents", json=body)
            if response.status_code != 201:
                print(f"\n{error_message(response)}", file=sys.stderr)
                return 1
            num_chunks += sum(len(d["chunks"]) for d in response.json()["documents"])
            bar.update(len(body["documents"]))
        try:
            num_uploaded, num_upload_chunks = upload_files(client, uploads, args)
        except UploadFailed as exc:
            print(f"\n{exc}", file=sys.stderr)
            return 1
    print(f"ingested {len(documents) + num_uploaded} documents, {num_chunks + num_upload_chunks} chunks")
    return 0
