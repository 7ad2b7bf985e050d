"""Uploads: every file is read and extracted (off the event loop) before anything is ingested, so a
bad file rejects the request with nothing stored; PDF chunks get their page in metadata.chunk_pages."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import anyio
from fastapi import UploadFile
from pydantic import ValidationError

from app.documents.protocol import DOCUMENT_ID_PATTERN, DocumentIn, IngestRequest
from app.documents.limits import KVBudget
from app.documents.serving import DocumentService
from app.errors import InvalidRequestError, PayloadTooLargeError
from app.extract import ExtractedDocument, ExtractionLimits, FileFormat, extract_file
from app.extract.dispatch import page_at
from app.extract.types import FileRejected
from app.uploads.protocol import UploadedDocument, UploadResponse
from configs.enums import ChunkingMode
from configs.settings import Settings
from retrieval.chunker import Chunker
from retrieval.store_types import CollectionRow


@dataclass
class UploadService:
    settings: Settings
    documents: DocumentService

    @property
    def limits(self) -> ExtractionLimits:
        return ExtractionLimits.of(self.settings.limits)

    async def upload(
        self, files: Sequence[UploadFile], chunking: ChunkingMode | None, precompute: bool,
        ids: Sequence[str] | None, collection: CollectionRow,
    ) -> UploadResponse:
        ids = _check_ids(ids, len(files))
        extracted = [doc for file, doc_id in zip(files, ids) for doc in await self._extract(file, doc_id)]
        self._check(extracted)
        chunking = chunking or self.settings.retrieval.chunking
        metadata = [await self._metadata(doc, chunking) for doc in extracted]
        request = IngestRequest(documents=[_document_in(doc, meta) for doc, meta in zip(extracted, metadata)],
                                chunking=chunking, precompute=precompute)
        kv_budget = KVBudget.of(self.settings, self.documents.engine)
        if kv_budget is not None:  # as the JSON route: KV that cannot fit the store's bound is a 413
            await kv_budget.check_request(request)
        ingested = await self.documents.ingest(request, collection)
        return UploadResponse(documents=[
            UploadedDocument(id=doc.id, collection=collection.name, title=doc.title, source=doc.metadata["source"], format=doc.file_format.value,
                             num_pages=doc.metadata.get("num_pages"), status=out.status,
                             chunks=out.chunks, warnings=[*doc.warnings, *out.warnings])
            for doc, out in zip(extracted, ingested.documents)
        ])

    async def _extract(self, file: UploadFile, doc_id: str | None) -> list[ExtractedDocument]:
        name = file.filename or "(unnamed file)"
        data = await file.read()
        try:
            return await anyio.to_thread.run_sync(extract_file, name, data, self.limits, doc_id)
        except FileRejected as exc:
            raise (PayloadTooLargeError if exc.is_too_large else InvalidRequestError)(exc.message) from exc

    def _check(self, docs: Sequence[ExtractedDocument]) -> None:
        limit = self.settings.limits.max_documents_per_request
        if len(docs) > limit:
            raise InvalidRequestError(f"{len(docs)} documents in one upload; the limit is {limit}")
        seen: dict[str, str] = {}
        for doc in docs:
            if doc.id in seen:
                raise InvalidRequestError(
                    f"{doc.metadata['source']} and {seen[doc.id]} both give document id {doc.id!r}; rename one"
                )
            seen[doc.id] = doc.metadata["source"]

    async def _metadata(self, doc: ExtractedDocument, chunking: ChunkingMode) -> dict:
        if doc.file_format is not FileFormat.PDF:
            return doc.metadata
        # The chunker cuts exactly as ingestion will, so chunk_pages[i] is the page where chunk i starts
        # (tokenizing only: off the event loop, not on the engine loop).
        chunker = self.documents.chunker
        spans = await anyio.to_thread.run_sync(chunk_pages, chunker, doc.text, chunking, doc.page_starts)
        return {**doc.metadata, "chunk_pages": [first for first, _ in spans],
                "chunk_last_pages": [last for _, last in spans]}


def _check_ids(ids: Sequence[str] | None, num_files: int) -> list[str | None]:
    """The client's ids, one per file (or None for each: ids from the names), checked like the JSON route's."""
    if not ids:
        return [None] * num_files
    if len(ids) != num_files:
        raise InvalidRequestError(f"{len(ids)} ids for {num_files} files; send one id per file, in order")
    for doc_id in ids:
        if not re.fullmatch(DOCUMENT_ID_PATTERN, doc_id):
            raise InvalidRequestError(f"ids: {doc_id[:200]!r} is not a valid document id ({DOCUMENT_ID_PATTERN})")
    return list(ids)


def _document_in(doc: ExtractedDocument, metadata: dict) -> DocumentIn:
    """The JSON route's document; what its validation refuses is this file's 422, not a 500."""
    try:
        return DocumentIn(id=doc.id, title=doc.title, text=doc.text, metadata=metadata)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:3])
        raise InvalidRequestError(f"{doc.metadata['source']}: document {doc.id!r} is invalid ({reasons})") from exc


def chunk_pages(chunker: Chunker, text: str, chunking: ChunkingMode,
                page_starts: Sequence[int]) -> list[tuple[int, int]]:
    """The 1-based first and last page of each chunk of `text` (`structure` chunks know their page; others
    are found in order in the text)."""
    pages, cursor = [], 0
    for chunk in chunker.split(text, chunking):
        if chunk.page is not None:  # never across a page break
            pages.append((chunk.page + 1, chunk.page + 1))
            continue
        found = text.find(chunk.text[:64], cursor)
        offset = found if found >= 0 else cursor  # a detokenized over-long sentence may not match exactly
        end = min(offset + len(chunk.text.rstrip()), len(text)) - 1  # its last character
        pages.append((page_at(page_starts, offset), page_at(page_starts, max(end, offset))))
        cursor = offset + 1
    return pages
