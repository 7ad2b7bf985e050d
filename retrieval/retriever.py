"""Retrieval: the embedder, the FAISS index and the document store kept consistent."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from configs.settings import RetrievalSettings
from retrieval.doc_store import DocumentStore, StoredChunk
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ScoredChunk:
    chunk: StoredChunk
    score: float | None  # cosine similarity; None when the chunk was named, not retrieved


class Retriever:
    def __init__(self, embedder: Embedder, index: VectorIndex, store: DocumentStore):
        self.embedder, self.index, self.store = embedder, index, store

    @classmethod
    def open(cls, data_dir: Path, settings: RetrievalSettings) -> Retriever:
        """Open (or create) the store and index under `data_dir`; rebuild the index if it is stale."""
        embedder = Embedder.from_name(settings.embedder, batch_size=settings.embed_batch_size)
        store = DocumentStore(data_dir / "documents.sqlite3")
        index = VectorIndex.load_or_create(data_dir / "index.faiss", embedder.dim, settings.index, settings.hnsw_m)
        retriever = cls(embedder, index, store)
        retriever._check_consistent()
        return retriever

    def _check_consistent(self) -> None:
        num_chunks = self.store.num_chunks()
        if self.index.num_vectors != num_chunks or self.index.loaded_kind is not self.index.kind:
            logger.warning("index has %d vectors, store %d chunks: rebuilding", self.index.num_vectors, num_chunks)
            self.index.rebuild(self.store.iter_embeddings())
            self.index.save()

    def search(self, question: str, top_k: int) -> list[ScoredChunk]:
        vector = self.embedder.encode([question])[0]
        hits = self.index.search(vector, top_k)
        chunks = self.store.chunks_by_row_ids([h.row_id for h in hits])
        return [ScoredChunk(chunks[h.row_id], h.score) for h in hits if h.row_id in chunks]

    def named(self, chunk_ids: Sequence[str]) -> tuple[list[ScoredChunk], list[str]]:
        """The chunks with these ids in this order, and the ids that do not exist."""
        found = self.store.chunks_by_ids(chunk_ids)
        missing = [cid for cid in chunk_ids if cid not in found]
        return [ScoredChunk(found[cid], None) for cid in chunk_ids if cid in found], missing

    def forget(self, chunks: Sequence[StoredChunk]) -> None:
        """Drop chunks (already deleted from the store) from the index."""
        if not chunks:
            return
        if self.index.supports_remove:
            self.index.remove(c.row_id for c in chunks)
        else:
            self.index.rebuild(self.store.iter_embeddings())

    def close(self) -> None:
        self.index.save()
        self.store.close()
