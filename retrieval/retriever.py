"""Retrieval: the embedder, the FAISS index and the document store kept consistent."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from configs.settings import RetrievalSettings
from retrieval.doc_store import DocumentStore, StoredChunk
from retrieval.embedder import Embedder
from retrieval.index import VectorIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reconciliation:
    """What start-up changed in the index to match the store (all zero: it already matched)."""

    num_added: int = 0
    num_removed: int = 0
    is_rebuilt: bool = False

    @property
    def is_changed(self) -> bool:
        return bool(self.num_added or self.num_removed or self.is_rebuilt)


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
        retriever.reconcile()
        return retriever

    def reconcile(self) -> Reconciliation:
        """Make the index hold exactly the store's chunks, compared by id sets (not counts).

        The store is the source of truth and every write commits there first; the index follows and
        is saved lazily, so after a crash it may miss new chunks and hold dead ones (row ids are
        never reused, so a dead id can never pass for a live chunk).
        """
        stored = self.store.row_ids()
        indexed = self.index.ids()
        has_duplicates = len(np.unique(indexed)) != len(indexed)
        indexed_set = set(indexed.tolist())
        missing, dead = sorted(stored - indexed_set), sorted(indexed_set - stored)
        if not missing and not dead and not has_duplicates and self.index.loaded_kind is self.index.kind:
            return Reconciliation()
        logger.warning("index out of step with the store: %d chunks missing, %d dead ids; reconciling",
                       len(missing), len(dead))
        if has_duplicates or self.index.loaded_kind is not self.index.kind or (dead and not self.index.supports_remove):
            self.index.rebuild(self.store.iter_embeddings())
            result = Reconciliation(len(missing), len(dead), is_rebuilt=True)
        else:
            if dead:
                self.index.remove(dead)
            if missing:
                self.index.add(*self.store.embeddings_of(missing))
            result = Reconciliation(len(missing), len(dead))
        self.index.save()
        return result

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

    def follow(
        self, removed: Sequence[StoredChunk], added_row_ids: Sequence[int], added_vectors: Sequence[np.ndarray]
    ) -> None:
        """Make the index follow a committed store write: drop `removed` chunks, add the new ones."""
        if removed and not self.index.supports_remove:
            self.index.rebuild(self.store.iter_embeddings())  # the store already holds the new chunks
            return
        if removed:
            self.index.remove(c.row_id for c in removed)
        if len(added_row_ids):
            self.index.add(np.asarray(added_row_ids, dtype=np.int64), np.stack(list(added_vectors)))

    def close(self) -> None:
        self.index.save()
        self.store.close()
