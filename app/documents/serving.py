"""Ingestion and document management (the write path itself: app/documents/writes.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import anyio

from app.documents.protocol import (
    ChunkDetail, ChunkOut, CollectionKV, DeleteResponse, DocumentDetail, DocumentIn, DocumentList, DocumentOut, DocumentSummary,
    IngestRequest, IngestResponse,
)
from app.documents.backfill import KVBackfill
from app.documents.limits import nominal_bytes_per_token
from app.documents.writes import DocumentWriter, WrittenDocument, content_id
from app.errors import IngestInterruptedError, InvalidRequestError, NotFoundError, PayloadTooLargeError
from app.worker import EngineWorker, Job, JobCancelled
from configs.settings import ChunkingMode, Settings
from retrieval.chunker import Chunker
from retrieval.doc_store import StoredChunk
from retrieval.retriever import Retriever


@dataclass
class DocumentService:
    settings: Settings
    engine: Any  # blend_engine.engine.BlendEngine
    retriever: Retriever
    kv_store: Any  # kv_store.KVStore
    chunker: Chunker
    worker: EngineWorker
    backfill: KVBackfill | None = None  # KV of large documents, between questions
    writer: DocumentWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = DocumentWriter(self.settings, self.engine, self.retriever, self.kv_store, self.chunker)

    def validate(self, request: IngestRequest) -> None:
        limits = self.settings.limits
        if len(request.documents) > limits.max_documents_per_request:
            raise InvalidRequestError(
                f"{len(request.documents)} documents in one request; the limit is {limits.max_documents_per_request}"
            )
        for doc in request.documents:
            if len(doc.text) > limits.max_document_chars:
                raise PayloadTooLargeError(
                    f"document {doc.id or '(new)'} has {len(doc.text)} characters; the limit is {limits.max_document_chars}"
                )
        ids = [doc.id for doc in request.documents if doc.id is not None]
        if len(ids) != len(set(ids)):
            raise InvalidRequestError("document ids repeat within the request")

    async def ingest(self, request: IngestRequest) -> IngestResponse:
        self.validate(request)
        chunking = request.chunking or self.settings.retrieval.chunking
        return await self.worker.run(lambda job: self._ingest(job, request, chunking))

    def _ingest(self, job: Job, request: IngestRequest, chunking: ChunkingMode) -> IngestResponse:
        """Each document is committed on its own; a failure names those committed before it."""
        written: list[WrittenDocument] = []
        try:
            for doc in request.documents:
                job.check()
                try:
                    written.append(self._write(doc, chunking, request.precompute))
                except JobCancelled:
                    raise
                except Exception as exc:
                    if not written:
                        raise
                    raise IngestInterruptedError([w.id for w in written], doc.id or content_id(doc), exc) from exc
        finally:
            self.retriever.index.save()
        return IngestResponse(documents=[self._document_out(w, self._is_backfilled(d, request.precompute))
                                         for w, d in zip(written, request.documents)])

    def _is_backfilled(self, doc: DocumentIn, precompute: bool) -> bool:
        """A large document: committed now, its KV computed in the background between questions."""
        return precompute and self.backfill is not None and len(doc.text) > self.settings.retrieval.max_inline_kv_chars

    def _write(self, doc: DocumentIn, chunking: ChunkingMode, precompute: bool) -> WrittenDocument:
        is_backfilled = self._is_backfilled(doc, precompute)
        written = self.writer.write(doc, chunking, precompute and not is_backfilled)
        if is_backfilled:
            self.backfill.schedule(written.chunks)
        return written

    def _document_out(self, written: WrittenDocument, is_backfilled: bool = False) -> DocumentOut:
        cached = self._cached(written.chunks)
        chunks = [ChunkOut(id=c.id, num_tokens=c.num_tokens, kv_cached=is_cached)
                  for c, is_cached in zip(written.chunks, cached)]
        return DocumentOut(id=written.id, status=written.status, chunks=chunks,
                           kv_pending=is_backfilled and not all(cached))

    def _cached(self, chunks: Sequence[StoredChunk]) -> list[bool]:
        """Whether each chunk has a sound KV entry now (batched: one header check or round trip each tier)."""
        keys = [c.kv_key for c in chunks if c.kv_key is not None]
        readable = dict(zip(keys, self.kv_store.readable_many(keys)))
        return [c.kv_key is not None and readable[c.kv_key] for c in chunks]

    async def delete(self, doc_id: str) -> DeleteResponse:
        return await self.worker.run(lambda job: self._delete(doc_id))

    def _delete(self, doc_id: str) -> DeleteResponse:
        chunks = self.writer.delete(doc_id)
        if chunks is None:
            raise NotFoundError(f"document not found: {doc_id}")
        return DeleteResponse(id=doc_id, deleted=True, num_chunks=len(chunks))

    async def get(self, doc_id: str) -> DocumentDetail:
        return await anyio.to_thread.run_sync(self._get, doc_id)  # SQLite and KV headers: off the event loop

    def _get(self, doc_id: str) -> DocumentDetail:
        doc = self.retriever.store.get_document(doc_id)
        if doc is None:
            raise NotFoundError(f"document not found: {doc_id}")
        cached = self._cached(doc.chunks)
        num_bytes = self.kv_store.entry_bytes([c.kv_key for c in doc.chunks if c.kv_key])
        return DocumentDetail(
            id=doc.id, title=doc.title, metadata=doc.metadata, num_chars=doc.num_chars, created_at=doc.created_at,
            chunks=[
                ChunkDetail(id=c.id, num_tokens=c.num_tokens, kv_cached=is_cached, position=c.position, text=c.text)
                for c, is_cached in zip(doc.chunks, cached)
            ],
            kv_bytes=sum(n or 0 for n in num_bytes), kv_cached_share=sum(cached) / len(cached) if cached else 0.0,
        )

    async def list(self, limit: int, offset: int) -> DocumentList:
        return await anyio.to_thread.run_sync(self._list, limit, offset)

    def _list(self, limit: int, offset: int) -> DocumentList:
        store = self.retriever.store
        rows = store.list_documents(limit, offset)
        keys = store.kv_keys_by_document([r.id for r in rows])
        documents = []
        for r in rows:  # from the budgeted tier's index: no entry is opened
            sizes = self.kv_store.entry_bytes([k for k in keys[r.id] if k]) if keys[r.id] else []
            held = [n for n in sizes if n is not None]
            documents.append(DocumentSummary(
                id=r.id, title=r.title, num_chunks=r.num_chunks, num_chars=r.num_chars, created_at=r.created_at,
                kv_bytes=sum(held), kv_cached_share=len(held) / r.num_chunks if r.num_chunks else 0.0,
            ))
        return DocumentList(documents=documents, total=store.num_documents(), kv=self._collection_kv())

    def _collection_kv(self) -> CollectionKV | None:
        budget = self.kv_store.budget_stats()
        if budget is None:
            return None
        per_token = budget.bytes_per_token or nominal_bytes_per_token(self.settings, self.engine)
        num_tokens = self.retriever.store.num_chunk_tokens()
        return CollectionKV(num_tokens=num_tokens, bytes_per_token=round(per_token, 1),
                            estimated_full_bytes=int(num_tokens * per_token), cached_bytes=budget.bytes_used,
                            budget_bytes=budget.budget_bytes)
