"""Ingestion and document management (the write path itself: app/documents/writes.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Sequence, TYPE_CHECKING

import anyio

from app.documents.protocol import (
    ChunkDetail, ChunkOut, CollectionKV, DeleteResponse, DocumentDetail, DocumentIn, DocumentList, DocumentOut, DocumentSummary,
    IngestRequest, IngestResponse,
)
from app.documents.backfill import KVBackfill
from app.documents.write_queue import Check, WriteQueue
from app.documents.limits import nominal_bytes_per_token
from app.documents.writes import DocumentWriter, WrittenDocument, content_id, kv_scope
from app.documents.limits import KVBudget
from app.documents.storage import SQLITE_BYTES_PER_TOKEN, DiskReserve, disk_full_error, is_disk_full
from app.collections.scope import not_found
from app.errors import (
    IngestInterruptedError, InsufficientStorageError, InvalidRequestError, NotFoundError, PayloadTooLargeError,
)
from blend_engine.kv import ChunkKV
from blend_engine.threads import pin_one_thread
from runtime.jobs import JobCancelled
from runtime.loop import EngineLoop
from app.extract.language import language_warning
from configs.enums import ChunkingMode
from configs.settings import Settings
from kv_store.single_flight import SingleFlight
from retrieval.chunker import Chunker
from retrieval.embedder import PACKAGED_MINILM
from retrieval.store_types import CollectionNotFoundError, CollectionRow, StoredChunk
from retrieval.retriever import Retriever

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine
    from kv_store import KVStore

logger = logging.getLogger(__name__)
ENGLISH_ONLY_EMBEDDERS = frozenset({PACKAGED_MINILM})  # a document in another language gets a warning


@dataclass
class DocumentService:
    settings: Settings
    engine: BlendEngine
    retriever: Retriever
    kv_store: KVStore
    chunker: Chunker
    loop: EngineLoop
    writes: WriteQueue
    backfill: KVBackfill | None = None  # KV of large documents, between questions
    single_flight: SingleFlight | None = None  # KV precompute once across replicas
    reserve: DiskReserve | None = None  # released for a DELETE on a full disk
    writer: DocumentWriter = field(init=False)

    def __post_init__(self) -> None:
        self.writer = DocumentWriter(self.settings, self.engine, self.retriever, self.kv_store, self.chunker,
                                     compute_kv=self._compute_kv, single_flight=self.single_flight)

    def _compute_kv(self, token_ids: list[int], context_ids: tuple[int, ...]) -> ChunkKV:
        """A chunk's KV, computed on the engine loop as one background unit (the write waits for it)."""
        return self.loop.call_background(lambda: self.engine.precompute(token_ids, context_ids))

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

    async def ingest(self, request: IngestRequest, collection: CollectionRow) -> IngestResponse:
        """Ingest into `collection` (resolved by the caller: app/collections/scope.py)."""
        self.validate(request)
        chunking = request.chunking or self.settings.retrieval.chunking
        return await self.writes.run(lambda check: self._ingest(check, request, chunking, collection))

    def _ingest(self, check: Check, request: IngestRequest, chunking: ChunkingMode,
                collection: CollectionRow) -> IngestResponse:
        """Each document is committed on its own; a failure names those committed before it."""
        pin_one_thread()  # the embedding runs torch on this side thread: one thread, no pool of its own
        written: list[WrittenDocument] = []
        try:
            for doc in request.documents:
                try:
                    check()  # a cancel (client gone, shutdown) stops between documents: those before are committed
                    written.append(self._write(doc, chunking, request.precompute, collection))
                except JobCancelled as exc:
                    if not written:
                        raise
                    # still a cancel (counted as one, no error logged), saying what is committed
                    raise JobCancelled(f"ingest stopped at document {doc.id or content_id(doc)} ({exc}); "
                                       f"committed before it: {', '.join(w.id for w in written)}; re-sending the "
                                       "request is safe") from exc
                except Exception as exc:
                    error = self._disk_full(exc, doc, request.precompute) if is_disk_full(exc) else exc
                    if isinstance(exc, CollectionNotFoundError):  # deleted meanwhile (perhaps via another replica)
                        error = not_found(collection.name)
                    if not written:
                        raise error from exc
                    raise IngestInterruptedError([w.id for w in written], doc.id or content_id(doc), error) from exc
        finally:
            self._save_index()
        return IngestResponse(documents=[self._document_out(w, collection.name,
                                                            self._is_backfilled(d, request.precompute), self._warnings(d))
                                         for w, d in zip(written, request.documents)])

    def _disk_full(self, exc: Exception, doc: DocumentIn, precompute: bool) -> InsufficientStorageError:
        """A 507 naming the full disk and what the document needs (its KV, if precomputed, and its rows)."""
        num_tokens = len(self.engine.tokenize(doc.text))
        budget = KVBudget.of(self.settings, self.engine) if precompute else None
        per_token = SQLITE_BYTES_PER_TOKEN + (budget.bytes_per_token if budget is not None else 0)
        directory = Path(exc.filename).parent if isinstance(exc, OSError) and exc.filename else self.settings.data_dir
        return disk_full_error(directory, f"document {doc.id or content_id(doc)} ({num_tokens} tokens)",
                               num_tokens * per_token)

    def _save_index(self) -> None:
        """Save the vector index; on a full disk, say so and go on: it is rebuilt from SQLite at start-up."""
        try:
            self.retriever.index.save()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            logger.warning("the vector index was not saved (the disk is full); start-up rebuilds it from the store")

    def _is_backfilled(self, doc: DocumentIn, precompute: bool) -> bool:
        """A large document: committed now, its KV computed in the background between questions."""
        return precompute and self.backfill is not None and len(doc.text) > self.settings.retrieval.max_inline_kv_chars

    def _write(self, doc: DocumentIn, chunking: ChunkingMode, precompute: bool,
               collection: CollectionRow) -> WrittenDocument:
        is_backfilled = self._is_backfilled(doc, precompute)
        written = self.writer.write(doc, chunking, precompute and not is_backfilled, collection)
        if is_backfilled:
            self.backfill.schedule(written.chunks, kv_scope(collection))
        return written

    def _document_out(self, written: WrittenDocument, collection: str, is_backfilled: bool = False,
                      warnings: Sequence[str] = ()) -> DocumentOut:
        cached = self._cached(written.chunks)
        chunks = [ChunkOut(id=c.id, num_tokens=c.num_tokens, kv_cached=is_cached)
                  for c, is_cached in zip(written.chunks, cached)]
        return DocumentOut(id=written.id, collection=collection, status=written.status, chunks=chunks,
                           kv_pending=is_backfilled and not all(cached), warnings=list(warnings))

    def _warnings(self, doc: DocumentIn) -> list[str]:
        """What may keep questions from finding the document's content: its language, for an English-only
        embedder."""
        warning = language_warning(doc.text, self.settings.retrieval.embedder, ENGLISH_ONLY_EMBEDDERS)
        return [warning] if warning else []

    def _cached(self, chunks: Sequence[StoredChunk]) -> list[bool]:
        """Whether each chunk has a sound KV entry now (batched: one header check or round trip each tier)."""
        keys = [c.kv_key for c in chunks if c.kv_key is not None]
        readable = dict(zip(keys, self.kv_store.readable_many(keys)))
        return [c.kv_key is not None and readable[c.kv_key] for c in chunks]

    async def delete(self, doc_id: str, collection: str) -> DeleteResponse:
        return await self.writes.run(lambda check: self._delete(doc_id, collection))

    def _delete(self, doc_id: str, collection: str) -> DeleteResponse:
        delete = partial(self.writer.delete, doc_id, collection, save_index=self._save_index)
        chunks = self.reserve.run_freeing(delete) if self.reserve is not None else delete()
        if chunks is None:
            raise NotFoundError(f"document not found: {doc_id}")
        return DeleteResponse(id=doc_id, collection=collection, deleted=True, num_chunks=len(chunks))

    async def delete_collection(self, name: str) -> list[StoredChunk] | None:
        """Delete a collection, its documents and their KV (the write queue's turn, like a delete)."""
        delete = partial(self.writer.delete_collection, name, save_index=self._save_index)
        return await self.writes.run(
            lambda check: self.reserve.run_freeing(delete) if self.reserve is not None else delete())

    async def find(self, doc_id: str, collections: Sequence[str]) -> str:
        """The one of `collections` holding a document `doc_id` (404 when none does, 422 when several)."""
        found = await anyio.to_thread.run_sync(self.retriever.store.collections_of_document, doc_id, list(collections))
        if not found:
            raise NotFoundError(f"document not found: {doc_id}")
        if len(found) > 1:
            raise InvalidRequestError(f"document {doc_id} is in several of the collections ({', '.join(found)}): "
                                      "name one with ?collection=")
        return found[0]

    async def get(self, doc_id: str, collection: str) -> DocumentDetail:
        return await anyio.to_thread.run_sync(self._get, doc_id, collection)  # the store and KV headers: off the loop

    def _get(self, doc_id: str, collection: str) -> DocumentDetail:
        doc = self.retriever.store.get_document(doc_id, collection)
        if doc is None:
            raise NotFoundError(f"document not found: {doc_id}")
        cached = self._cached(doc.chunks)
        num_bytes = self.kv_store.entry_bytes([c.kv_key for c in doc.chunks if c.kv_key])
        return DocumentDetail(
            id=doc.id, collection=doc.collection, title=doc.title, metadata=doc.metadata, num_chars=doc.num_chars, created_at=doc.created_at,
            chunks=[
                ChunkDetail(id=c.id, num_tokens=c.num_tokens, kv_cached=is_cached, position=c.position, text=c.text)
                for c, is_cached in zip(doc.chunks, cached)
            ],
            kv_bytes=sum(n or 0 for n in num_bytes), kv_cached_share=sum(cached) / len(cached) if cached else 0.0,
        )

    async def list(self, limit: int, offset: int, collections: Sequence[CollectionRow]) -> DocumentList:
        return await anyio.to_thread.run_sync(self._list, limit, offset, collections)

    def _list(self, limit: int, offset: int, collections: Sequence[CollectionRow]) -> DocumentList:
        store, names = self.retriever.store, [c.name for c in collections]
        rows = store.list_documents(limit, offset, names)
        keys: dict[tuple[str, str], list[str | None]] = {}
        for name in dict.fromkeys(r.collection for r in rows):
            found = store.kv_keys_by_document([r.id for r in rows if r.collection == name], name)
            keys.update(((name, doc_id), kv_keys) for doc_id, kv_keys in found.items())
        documents = []
        for r in rows:  # from the budgeted tier's index: no entry is opened
            doc_keys = keys[(r.collection, r.id)]
            sizes = self.kv_store.entry_bytes([k for k in doc_keys if k]) if doc_keys else []
            held = [n for n in sizes if n is not None]
            documents.append(DocumentSummary(
                id=r.id, collection=r.collection, title=r.title, num_chunks=r.num_chunks, num_chars=r.num_chars,
                created_at=r.created_at, kv_bytes=sum(held),
                kv_cached_share=len(held) / r.num_chunks if r.num_chunks else 0.0,
            ))
        return DocumentList(documents=documents, total=store.num_documents(names), collections=names,
                            kv=self._collection_kv(collections))

    def _collection_kv(self, collections: Sequence[CollectionRow]) -> CollectionKV | None:
        """These collections' KV only: what others hold is no caller's business (nor its sizes)."""
        budget = self.kv_store.budget_stats()
        if budget is None:
            return None
        names = [c.name for c in collections]
        per_token = budget.bytes_per_token or nominal_bytes_per_token(self.settings, self.engine)
        num_tokens = self.retriever.store.num_chunk_tokens(names)
        held = self.kv_store.entry_bytes(sorted(self.retriever.store.kv_keys(names)))
        own = [c.kv_budget_bytes for c in collections]
        budget_bytes = own[0] if len(own) == 1 and own[0] is not None else budget.budget_bytes
        return CollectionKV(num_tokens=num_tokens, bytes_per_token=round(per_token, 1),
                            estimated_full_bytes=int(num_tokens * per_token), cached_bytes=sum(n or 0 for n in held),
                            budget_bytes=budget_bytes)
