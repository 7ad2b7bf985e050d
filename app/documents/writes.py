"""The ordered, idempotent write path of documents (one write at a time: app/documents/write_queue.py).

The document store (SQLite, or Postgres shared by replicas) is the one source of truth. Each
document is written in this order:
1. prepare: chunk, embed, precompute the chunks' KV into the store while the collection's KV budget
   has free room (the rest is computed when first used, kv_store/admission.py); content-addressed
   entries: if the process dies here they are orphans, deleted by the start-up garbage collection;
2. commit: one store transaction replaces the document and its chunks (atomic per document);
3. follow: the prefix cache drops every kept prompt holding a replaced chunk, the vector index drops
   the replaced chunks' ids and adds the new ones (saved at the end of the request; start-up
   reconciles it with the store by id sets), and the KV of replaced chunks no other chunk shares is
   deleted (orphans again if the process dies first).
Every step can be redone, so re-sending a request is safe; a document whose content hash is
already stored is left as it is ('unchanged').
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Callable, Sequence, TYPE_CHECKING

from app.documents.protocol import DocumentIn, DocumentStatus
from configs.enums import ChunkingMode
from configs.settings import Settings
from kv_store.admission import Admission
from kv_store.keys import KVScope
from kv_store.single_flight import PrecomputeLocks, PrecomputeReason, SingleFlight
from retrieval.chunker import Chunker, TextChunk
from retrieval.store_types import CollectionRow, NewChunk, StoredChunk
from retrieval.retriever import Retriever

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine
    from blend_engine.kv import ChunkKV
    from kv_store import KVStore


def kv_scope(collection: CollectionRow) -> KVScope:
    """The KV namespace of a collection's chunks: its salt, its name (what its entries are accounted
    to) and its own budget."""
    return KVScope(collection.kv_salt, collection.name, collection.kv_budget_bytes)


@dataclass(frozen=True)
class WrittenDocument:
    id: str
    status: DocumentStatus
    chunks: list[StoredChunk]


@dataclass
class DocumentWriter:
    settings: Settings
    engine: BlendEngine
    retriever: Retriever
    kv_store: KVStore
    chunker: Chunker
    # computes a chunk's KV (the engine's precompute, run on the engine loop); default: the engine's own
    compute_kv: Callable[[list[int], tuple[int, ...]], ChunkKV] | None = None
    single_flight: SingleFlight | None = None  # one replica precomputes a chunk, others wait (Redis lock)
    _flight: SingleFlight = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._flight = self.single_flight or SingleFlight(self.kv_store, PrecomputeLocks(None, 1.0))

    def write(self, doc: DocumentIn, chunking: ChunkingMode, precompute: bool,
              collection: CollectionRow) -> WrittenDocument:
        """Write `doc` into `collection` (CollectionNotFoundError if it was deleted meanwhile)."""
        store, name, scope = self.retriever.store, collection.name, kv_scope(collection)
        context_ids = tuple(self.engine.sink_ids(self.settings.blend.sink))
        doc_id = doc.id or content_id(doc)
        content_hash = self._content_hash(doc, chunking, context_ids, scope)
        if store.content_hash(doc_id, name) == content_hash:
            stored = store.get_document(doc_id, name)
            if stored is not None:
                if precompute:
                    self._fill_kv(stored.chunks, context_ids, scope)
                return WrittenDocument(doc_id, DocumentStatus.UNCHANGED, stored.chunks)
        new_chunks = self._prepare(self.chunker.split(doc.text, chunking, is_markdown=is_markdown(doc)), context_ids,
                                   precompute, scope)
        result = store.put_document(  # the commit point
            doc_id, doc.title, doc.metadata or {}, len(doc.text), new_chunks, content_hash, name
        )
        if result.is_unchanged:  # another replica committed the same content meanwhile: one version
            return WrittenDocument(doc_id, DocumentStatus.UNCHANGED, result.document.chunks)
        stored, replaced = result.document, result.replaced
        self.forget_prompts(replaced)
        self.retriever.follow(replaced, stored.chunks, [n.embedding for n in new_chunks])
        self.release_kv(replaced)
        status = DocumentStatus.REPLACED if replaced else DocumentStatus.CREATED
        return WrittenDocument(doc_id, status, stored.chunks)

    def delete(self, doc_id: str, collection: str,
               save_index: Callable[[], None] | None = None) -> list[StoredChunk] | None:
        """`save_index`: how to save the index (default: index.save)."""
        chunks = self.retriever.store.delete_document(doc_id, collection)  # the commit point
        if chunks is None:
            return None
        self.forget_prompts(chunks)
        self.retriever.follow(chunks, [], [])
        (save_index or self.retriever.index.save)()
        self.release_kv(chunks)
        return chunks

    def delete_collection(self, name: str, save_index: Callable[[], None] | None = None) -> list[StoredChunk] | None:
        """The same order as a document's delete: the store's transaction (the collection, its documents
        and chunks, its keys' grants) is the commit point; then the index drops the chunks and the KV no
        other chunk shares is deleted. Killed after the commit, start-up reconciles the index by id sets
        and collects the orphan KV (docs/design/server.md#crash-consistency)."""
        chunks = self.retriever.store.delete_collection(name)  # the commit point
        if chunks is None:
            return None
        self.retriever.follow(chunks, [], [])
        (save_index or self.retriever.index.save)()
        self.release_kv(chunks)
        if self.kv_store.admission is not None:
            self.kv_store.admission.forget_owner(name)
        return chunks

    def _prepare(self, chunks: Sequence[TextChunk], context_ids: tuple[int, ...], precompute: bool,
                 scope: KVScope) -> list[NewChunk]:
        embeddings = self.retriever.embedder.encode([c.text for c in chunks])
        keys = [self.kv_store.key_for(c.token_ids, context_ids, scope.salt) for c in chunks]
        if precompute:  # a damaged entry reads as absent (and is deleted): computed again
            self._precompute([(key, c.token_ids) for c, key in zip(chunks, keys)], context_ids, scope)
        return [NewChunk(c.text, c.token_ids, e, key) for c, e, key in zip(chunks, embeddings, keys)]

    def _fill_kv(self, chunks: Sequence[StoredChunk], context_ids: tuple[int, ...], scope: KVScope) -> None:
        """Precompute the entries an unchanged document lacks (never precomputed, evicted, damaged)."""
        self._precompute([(c.kv_key, c.token_ids) for c in chunks if c.kv_key is not None], context_ids, scope)

    def _precompute(self, chunks: Sequence[tuple[str, Sequence[int]]], context_ids: tuple[int, ...],
                    scope: KVScope) -> None:
        """Compute and offer the missing entries of (key, token ids) while the budget has room: beyond
        it, nothing is computed (the rest come when questions use them). Once across replicas: another
        replica computing the same chunk is waited for (on this write's thread), not repeated; the
        compute itself runs where `compute_kv` runs it (the engine loop)."""
        compute = self.compute_kv or self.engine.precompute
        readable = self.kv_store.readable_many([key for key, _ in chunks])
        for (key, token_ids), is_readable in zip(chunks, readable):
            if is_readable:
                continue
            if not self.kv_store.should_compute(key, len(token_ids), Admission.PRECOMPUTE, scope):
                continue
            self._flight.ensure(key, lambda ids=token_ids: compute(list(ids), context_ids), PrecomputeReason.INGEST,
                                Admission.PRECOMPUTE, scope)

    def forget_prompts(self, chunks: Sequence[StoredChunk]) -> int:
        """Drop the prompts the prefix cache keeps that hold one of these (replaced or deleted) chunks."""
        return self.kv_store.prompts.invalidate_chunks(c.kv_key for c in chunks if c.kv_key)

    def release_kv(self, chunks: Sequence[StoredChunk]) -> None:
        """Delete the KV of chunks that are gone, unless another chunk shares the same content."""
        for key in {c.kv_key for c in chunks if c.kv_key}:
            if not self.retriever.store.is_kv_key_used(key):
                self.kv_store.delete(key)

    def _content_hash(self, doc: DocumentIn, chunking: ChunkingMode, context_ids: tuple[int, ...],
                      scope: KVScope) -> str:
        """What the stored document is built from: its content, the chunking, and (through an empty
        chunk's key) the model fingerprint, KV format, precompute context and the collection's salt."""
        retrieval = self.settings.retrieval
        parts = {
            "content": content_id(doc), "chunking": chunking.value, "chunk_tokens": retrieval.chunk_tokens,
            "chunk_overlap": retrieval.chunk_overlap, "embedder": retrieval.embedder,
            "kv": self.kv_store.key_for((), context_ids, scope.salt),
        }
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# Formats whose extracted text marks headings with Markdown's `#` (DOCX and html2text's output do); in
# others (configuration files, scripts, plain text) a `#` line is a comment.
MARKDOWN_FORMATS = frozenset({"markdown", "docx", "html"})


def is_markdown(doc: DocumentIn) -> bool:
    """Whether `structure` chunking reads `#` lines as headings: by `metadata.format` (set by uploads;
    a JSON document may set it too)."""
    return (doc.metadata or {}).get("format") in MARKDOWN_FORMATS


def content_id(doc: DocumentIn) -> str:
    """The id of a document sent without one: a hash of its content, so re-sending it is a no-op."""
    payload = json.dumps({"text": doc.text, "title": doc.title, "metadata": doc.metadata or {}}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]
