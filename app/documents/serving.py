"""Ingestion and document management: chunk, embed, index and precompute KV; delete and replace."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from app.documents.protocol import (
    ChunkDetail, ChunkOut, DeleteResponse, DocumentDetail, DocumentList, DocumentOut, DocumentSummary,
    IngestRequest, IngestResponse,
)
from app.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from app.worker import EngineWorker, Job
from configs.settings import ChunkingMode, Settings
from retrieval.chunker import Chunker, TextChunk
from retrieval.doc_store import NewChunk, StoredChunk, StoredDocument
from retrieval.retriever import Retriever


@dataclass
class DocumentService:
    settings: Settings
    engine: Any  # blend_engine.engine.BlendEngine
    retriever: Retriever
    kv_store: Any  # kv_store.KVStore
    chunker: Chunker
    worker: EngineWorker

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
        out = []
        try:
            for doc in request.documents:
                job.check()
                doc_id = doc.id or uuid.uuid4().hex
                chunks = self.chunker.split(doc.text, chunking)
                new_chunks = self._prepare(chunks, request.precompute)
                stored, replaced = self.retriever.store.put_document(
                    doc_id, doc.title, doc.metadata or {}, len(doc.text), new_chunks
                )
                self.retriever.forget(replaced)
                self.retriever.index.add(
                    [c.row_id for c in stored.chunks], [n.embedding for n in new_chunks]
                )
                self._release_kv(replaced)
                out.append(DocumentOut(id=doc_id, chunks=[self._chunk_out(c) for c in stored.chunks]))
        finally:
            self.retriever.index.save()
        return IngestResponse(documents=out)

    def _prepare(self, chunks: Sequence[TextChunk], precompute: bool) -> list[NewChunk]:
        embeddings = self.retriever.embedder.encode([c.text for c in chunks])
        context_ids = tuple(self.engine.sink_ids(self.settings.blend.sink))
        prepared = []
        for chunk, embedding in zip(chunks, embeddings):
            key = self.kv_store.key_for(chunk.token_ids, context_ids)
            if precompute and not self.kv_store.contains(key):
                self.kv_store.put(key, self.engine.precompute(list(chunk.token_ids), context_ids))
            prepared.append(NewChunk(chunk.text, chunk.token_ids, embedding, key))
        return prepared

    def _release_kv(self, chunks: Sequence[StoredChunk]) -> None:
        """Delete the KV of chunks that are gone, unless another chunk shares the same content."""
        for key in {c.kv_key for c in chunks if c.kv_key}:
            if not self.retriever.store.is_kv_key_used(key):
                self.kv_store.delete(key)

    def _chunk_out(self, chunk: StoredChunk) -> ChunkOut:
        return ChunkOut(id=chunk.id, num_tokens=chunk.num_tokens, kv_cached=self._is_cached(chunk))

    def _is_cached(self, chunk: StoredChunk) -> bool:
        return chunk.kv_key is not None and bool(self.kv_store.contains(chunk.kv_key))

    async def delete(self, doc_id: str) -> DeleteResponse:
        return await self.worker.run(lambda job: self._delete(doc_id))

    def _delete(self, doc_id: str) -> DeleteResponse:
        chunks = self.retriever.store.delete_document(doc_id)
        if chunks is None:
            raise NotFoundError(f"document not found: {doc_id}")
        self.retriever.forget(chunks)
        self.retriever.index.save()
        self._release_kv(chunks)
        return DeleteResponse(id=doc_id, deleted=True, num_chunks=len(chunks))

    def get(self, doc_id: str) -> DocumentDetail:
        doc = self.retriever.store.get_document(doc_id)
        if doc is None:
            raise NotFoundError(f"document not found: {doc_id}")
        return DocumentDetail(
            id=doc.id, title=doc.title, metadata=doc.metadata, num_chars=doc.num_chars, created_at=doc.created_at,
            chunks=[
                ChunkDetail(id=c.id, num_tokens=c.num_tokens, kv_cached=self._is_cached(c), position=c.position,
                            text=c.text)
                for c in doc.chunks
            ],
        )

    def list(self, limit: int, offset: int) -> DocumentList:
        docs = self.retriever.store.list_documents(limit, offset)
        return DocumentList(documents=[_summary(d) for d in docs], total=self.retriever.store.num_documents())


def _summary(doc: StoredDocument) -> DocumentSummary:
    return DocumentSummary(
        id=doc.id, title=doc.title, num_chunks=len(doc.chunks), num_chars=doc.num_chars, created_at=doc.created_at
    )
