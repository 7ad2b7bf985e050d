"""The document store's interface and its row types: one Protocol, two implementations (SQLite
embedded in one process: retrieval/doc_store.py; Postgres shared by replicas: retrieval/pg_store.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np


class StoreUnavailableError(RuntimeError):
    """The document store's server cannot be reached (Postgres down or restarting): nothing was
    written by the failed call; the request may be retried (the API answers 503)."""


@dataclass(frozen=True)
class NewChunk:
    text: str
    token_ids: tuple[int, ...]
    embedding: np.ndarray  # [dim] float32
    kv_key: str | None = None


@dataclass(frozen=True)
class StoredChunk:
    row_id: int
    id: str
    document_id: str
    position: int
    text: str
    token_ids: tuple[int, ...]
    kv_key: str | None
    title: str | None = None
    pages: tuple[int, int] | None = None  # PDFs: the first and last page the chunk's text is on

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class DocumentSummaryRow:
    id: str
    title: str | None
    num_chunks: int
    num_chars: int
    created_at: float


@dataclass(frozen=True)
class StoredDocument:
    id: str
    title: str | None
    metadata: dict[str, Any]
    num_chars: int
    created_at: float
    chunks: list[StoredChunk] = field(default_factory=list)


@dataclass(frozen=True)
class PutResult:
    """What `put_document` committed: the document as stored, the chunks it replaced, and whether the
    same content (hash) was stored already, in which case nothing was written (a concurrent re-send
    through another replica keeps one version)."""

    document: StoredDocument
    replaced: list[StoredChunk]
    is_unchanged: bool = False


@dataclass(frozen=True)
class ExportedDocument:
    """A whole document with its chunks' embeddings: what copying one store into another needs."""

    document: StoredDocument
    content_hash: str | None
    chunks: list[NewChunk]


@dataclass(frozen=True)
class Changes:
    """Chunk row ids touched (added or removed) by the commits after a sequence number, up to `seq`.
    `is_complete` False: the log no longer reaches back that far (pruned): reconcile by id sets."""

    seq: int
    row_ids: frozenset[int]
    is_complete: bool = True


@runtime_checkable
class DocumentStore(Protocol):
    """Documents and their chunks (text, token ids, KV key, embedding). Every write is one
    transaction (the commit point of a document); chunk row ids (the vector index's ids) are never
    reused. Thread-safe."""

    @property
    def is_shared(self) -> bool:
        """Whether other processes write it too (their commits arrive through `changes_since`)."""
        ...

    def close(self) -> None: ...

    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk],
        content_hash: str | None = None,
    ) -> PutResult:
        """Insert (or replace) a document and its chunks in one transaction: after a crash either the
        old or the new version is stored, never a mix. When `content_hash` is given and already
        stored for `doc_id`, nothing is written (`is_unchanged`)."""
        ...

    def delete_document(self, doc_id: str) -> list[StoredChunk] | None:
        """Delete a document; returns its chunks, or None when there was no such document."""
        ...

    def get_document(self, doc_id: str) -> StoredDocument | None: ...

    def content_hash(self, doc_id: str) -> str | None:
        """The hash a stored document was built from (None: no such document, or stored before hashes)."""
        ...

    def list_documents(self, limit: int = 100, offset: int = 0) -> list[DocumentSummaryRow]: ...

    def chunks_by_row_ids(self, row_ids: Sequence[int]) -> dict[int, StoredChunk]: ...

    def chunks_by_ids(self, chunk_ids: Sequence[str]) -> dict[str, StoredChunk]: ...

    def lexical_search(self, question: str, limit: int) -> list[tuple[int, float]]:
        """(row id, score: higher is better) of up to `limit` chunks holding the question's words, best
        first: the store's full-text index (SQLite FTS5, Postgres tsvector), written in the same
        transaction as the chunks."""
        ...

    def set_kv_key(self, chunk_id: str, kv_key: str | None) -> None: ...

    def is_kv_key_used(self, kv_key: str) -> bool:
        """Whether any chunk still points at this (content-addressed, so shareable) KV entry."""
        ...

    def num_documents(self) -> int: ...

    def num_chunks(self) -> int: ...

    def row_ids(self) -> set[int]:
        """Every chunk's row id: what the vector index must hold, exactly."""
        ...

    def kv_keys(self) -> set[str]:
        """Every KV key a chunk points at: the KV entries that must not be garbage-collected."""
        ...

    def kv_keys_by_document(self, doc_ids: Sequence[str]) -> dict[str, list[str | None]]:
        """Each document's chunks' KV keys, in position order (no text or token ids read)."""
        ...

    def num_chunk_tokens(self) -> int:
        """Tokens over every chunk (overlaps counted in each chunk): what the collection's KV covers."""
        ...

    def embeddings_of(self, row_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(row_ids [n] int64, embeddings [n, dim] float32) of these chunks (those that exist)."""
        ...

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(row_ids [n] int64, embeddings [n, dim] float32) batches of every chunk, for index rebuilds."""
        ...

    def change_seq(self) -> int:
        """The sequence number of the last committed change (0: none, or a store nobody else writes)."""
        ...

    def changes_since(self, seq: int) -> Changes:
        """The chunk row ids touched by the commits after `seq` (in commit order), for the index to follow."""
        ...

    def export_documents(self) -> Iterator[ExportedDocument]:
        """Every document, whole, with its chunks' embeddings (for copying the store elsewhere)."""
        ...


def chunk_pages(first: Any, last: Any) -> tuple[int, int] | None:
    """(first, last) page from a chunk's metadata; a document stored before chunk_last_pages has its first only."""
    if not isinstance(first, int) or isinstance(first, bool):
        return None
    return (first, last if isinstance(last, int) and not isinstance(last, bool) and last >= first else first)
