"""The document store's interface and its row types: one Protocol, two implementations (SQLite
embedded in one process: retrieval/doc_store.py; Postgres shared by replicas: retrieval/pg_store.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

# Every document belongs to exactly one collection (a knowledge base); documents sent without one, and
# every document of a store made before collections, are in this one. It cannot be deleted.
DEFAULT_COLLECTION = "default"
# No '/' (chunk ids join the collection and the document id with it) and no ':' (a model name picks a
# collection as `<model>:<collection>`): a name is also a file name (its vector index's).
COLLECTION_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"


class StoreUnavailableError(RuntimeError):
    """The document store's server cannot be reached (Postgres down or restarting): nothing was
    written by the failed call; the request may be retried (the API answers 503)."""


class CollectionNotFoundError(LookupError):
    """The collection a write names does not exist (deleted meanwhile, perhaps through another replica):
    nothing was written."""


class CollectionExistsError(ValueError):
    """A collection (or key id) of that name exists already: nothing was written."""


def chunk_id_of(collection: str, doc_id: str, position: int) -> str:
    """A chunk's id, unique across collections: `doc#3` in the default collection (as before
    collections, so ids of an upgraded store stay valid), `hr/doc#3` in the others."""
    return f"{doc_id}#{position}" if collection == DEFAULT_COLLECTION else f"{collection}/{doc_id}#{position}"


@dataclass(frozen=True)
class CollectionRow:
    """A collection as stored. `kv_salt` is part of its chunks' KV keys (kv_store/keys.py), so the same
    text in two collections is two entries and no collection can tell by timing what another caches;
    collections that share KV (`shares_kv`) have one common salt."""

    name: str
    description: str
    created_at: float
    kv_salt: str
    shares_kv: bool = False
    kv_budget_bytes: int | None = None  # its own KV budget in the budgeted tier (None: the store's only)


@dataclass(frozen=True)
class CollectionCounts:
    num_documents: int = 0
    num_chunks: int = 0
    num_tokens: int = 0  # over every chunk (overlaps counted in each chunk)


@dataclass(frozen=True)
class KeyRow:
    """An API key as stored: the sha256 of its token, never the token."""

    id: str
    name: str
    token_hash: str
    role: str  # read, write or admin (app/auth/principal.py: Role)
    collections: tuple[str, ...]
    created_at: float
    revoked_at: float | None = None


class EmbeddingBatch(NamedTuple):
    row_ids: np.ndarray  # [n] int64
    vectors: np.ndarray  # [n, dim] float32
    collections: tuple[str, ...]  # [n]: each chunk's collection (its vector index)


@dataclass(frozen=True)
class FusedHit:
    """One chunk of a hybrid ranking (DocumentStore.fused_rows)."""

    chunk: StoredChunk
    rank_score: float  # its reciprocal rank fusion score
    embedding: np.ndarray | None  # [dim] float32 where the dense ranking did not hold it (its cosine is made from it)


@dataclass(frozen=True)
class NewChunk:
    text: str
    token_ids: tuple[int, ...]
    embedding: np.ndarray  # [dim] float32
    kv_key: str | None = None


@dataclass(frozen=True)
class ChunkTokens:
    """A stored chunk's text tokenized again, and its KV key for those tokens."""

    chunk_id: str
    token_ids: tuple[int, ...]
    kv_key: str


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
    collection: str = DEFAULT_COLLECTION

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
    collection: str = DEFAULT_COLLECTION


@dataclass(frozen=True)
class StoredDocument:
    id: str
    title: str | None
    metadata: dict[str, Any]
    num_chars: int
    created_at: float
    chunks: list[StoredChunk] = field(default_factory=list)
    collection: str = DEFAULT_COLLECTION


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

    document: StoredDocument  # its collection: document.collection
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
    """Collections, their documents and chunks (text, token ids, KV key, embedding), and API keys.
    Every write is one transaction (the commit point of a document, or of a whole collection's
    deletion); chunk row ids (the vector index's ids) are never reused. A document is identified by
    its collection and its id. Thread-safe. The schema carries a version; opening an older store
    migrates it in place (each store's numbered `_MIGRATIONS`)."""

    @property
    def is_shared(self) -> bool:
        """Whether other processes write it too (their commits arrive through `changes_since`)."""
        ...

    def close(self) -> None: ...

    # --- documents ---------------------------------------------------------------------------------
    def put_document(
        self, doc_id: str, title: str | None, metadata: dict[str, Any], num_chars: int, chunks: Sequence[NewChunk],
        content_hash: str | None = None, collection: str = DEFAULT_COLLECTION,
    ) -> PutResult:
        """Insert (or replace) a document and its chunks in one transaction: after a crash either the
        old or the new version is stored, never a mix. When `content_hash` is given and already
        stored for `doc_id`, nothing is written (`is_unchanged`). CollectionNotFoundError when the
        collection does not exist."""
        ...

    def delete_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> list[StoredChunk] | None:
        """Delete a document; returns its chunks, or None when there was no such document."""
        ...

    def get_document(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> StoredDocument | None: ...

    def content_hash(self, doc_id: str, collection: str = DEFAULT_COLLECTION) -> str | None:
        """The hash a stored document was built from (None: no such document, or stored before hashes)."""
        ...

    def list_documents(self, limit: int = 100, offset: int = 0,
                       collections: Sequence[str] = (DEFAULT_COLLECTION,)) -> list[DocumentSummaryRow]: ...

    def collections_of_document(self, doc_id: str, collections: Sequence[str]) -> list[str]:
        """Which of `collections` hold a document with this id."""
        ...

    def chunks_by_row_ids(self, row_ids: Sequence[int]) -> dict[int, StoredChunk]: ...

    def chunks_by_ids(self, chunk_ids: Sequence[str], collections: Sequence[str] | None = None) -> dict[str, StoredChunk]:
        """The chunks with these ids, in `collections` only (None: in any)."""
        ...

    def lexical_search(self, question: str, limit: int, collections: Sequence[str]) -> list[tuple[int, float]]:
        """(row id, score: higher is better) of up to `limit` chunks of `collections` holding the question's
        words, best first: the store's full-text index (SQLite FTS5, Postgres tsvector), written in the
        same transaction as the chunks."""
        ...

    def missing_words(self, words: Sequence[str], collections: Sequence[str]) -> list[str]:
        """The `words` (single words: letters and digits) that no chunk of `collections` holds, by the
        full-text index (stemmed as it stems; a word the index drops as a stop word counts as held)."""
        ...

    def name_hits(self, names: Sequence[str], limit: int, collections: Sequence[str]) -> dict[str, list[int]]:
        """For each of `names` (a question's `named_words`: "LineMax", "fail_interval", "core.autocrlf") held by
        at most `limit` chunks of `collections`, the row ids of those chunks, ascending: the name's words in
        its order, as a phrase of the full-text index (stemmed as it stems). A name held by more chunks picks
        nothing out and is left out, as is one held by none, and one naming a document (`entry_name_hits`)."""
        ...

    def fused_rows(self, ranked: Sequence[tuple[int, float]], dense: Collection[int]) -> list[FusedHit]:
        """Hybrid retrieval's rows: the chunks of a fused ranking ((row id, fusion score), best first) in its
        order, each with its stored embedding where the dense ranking (`dense`: its row ids) did not hold it.
        A chunk gone since the rankings is left out. SQLite composes its own calls (`rows_of_ranking`);
        Postgres runs it as one statement (one round trip instead of two)."""
        ...

    def iter_chunks(self, batch_size: int = 1024) -> Iterator[list[StoredChunk]]:
        """Every chunk, by row id, a page of `batch_size` at a time (nothing held between pages)."""
        ...

    def set_chunk_embeddings(self, row_ids: Sequence[int], vectors: np.ndarray) -> None:
        """Replace these chunks' embeddings (`vectors` [n, dim] float32, row by row) in one transaction:
        another embedder's (retrieval/reembed.py)."""
        ...

    def set_chunk_tokens(self, updates: Sequence[ChunkTokens]) -> None:
        """Give these chunks (by id) new token ids and KV keys, in one transaction: their text, embedding
        and row id stay (a rebuild for another model: app/documents/rebuild.py)."""
        ...

    def is_kv_key_used(self, kv_key: str) -> bool:
        """Whether any chunk still points at this (content-addressed, so shareable) KV entry."""
        ...

    def collection_of_kv_key(self, kv_key: str) -> str | None:
        """A collection one of whose chunks points at this KV entry (None: no chunk does: it is dead)."""
        ...

    def num_documents(self, collections: Sequence[str] | None = None) -> int:
        """Documents in `collections` (None: in all)."""
        ...

    def num_chunks(self, collections: Sequence[str] | None = None) -> int: ...

    def row_ids(self) -> set[int]:
        """Every chunk's row id: what the vector indexes must hold, exactly."""
        ...

    def kv_keys(self, collections: Sequence[str] | None = None) -> set[str]:
        """Every KV key a chunk (of `collections`; None: of any) points at: the entries that must not be
        garbage-collected."""
        ...

    def kv_keys_by_document(self, doc_ids: Sequence[str],
                            collection: str = DEFAULT_COLLECTION) -> dict[str, list[str | None]]:
        """Each document's chunks' KV keys, in position order (no text or token ids read)."""
        ...

    def num_chunk_tokens(self, collections: Sequence[str] | None = None) -> int:
        """Tokens over every chunk (overlaps counted in each chunk) of `collections` (None: of all)."""
        ...

    def embeddings_of(self, row_ids: Sequence[int]) -> EmbeddingBatch:
        """These chunks' (those that exist) row ids, embeddings and collections."""
        ...

    def iter_embeddings(self, batch_size: int = 1024) -> Iterator[EmbeddingBatch]:
        """Every chunk's row id, embedding and collection, in batches, for index rebuilds."""
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

    # --- collections -------------------------------------------------------------------------------
    def create_collection(self, row: CollectionRow) -> CollectionRow:
        """CollectionExistsError when one of that name exists."""
        ...

    def get_collection(self, name: str) -> CollectionRow | None: ...

    def list_collections(self) -> list[CollectionRow]:
        """Every collection, by name."""
        ...

    def update_collection(self, row: CollectionRow) -> bool:
        """Write `row`'s description and KV budget (its salt and sharing never change); False: no such
        collection."""
        ...

    def delete_collection(self, name: str) -> list[StoredChunk] | None:
        """Delete a collection, its documents and chunks, and its keys' grants to it, in one
        transaction (the commit point); returns the chunks (for the index and the KV to follow), or
        None when there was no such collection."""
        ...

    def collection_counts(self, names: Sequence[str]) -> dict[str, CollectionCounts]: ...

    # --- API keys ----------------------------------------------------------------------------------
    def create_key(self, row: KeyRow) -> KeyRow:
        """CollectionNotFoundError when one of its collections does not exist."""
        ...

    def get_key(self, key_id: str) -> KeyRow | None:
        """The key (revoked or not); its collections are those that still exist."""
        ...

    def list_keys(self) -> list[KeyRow]: ...

    def has_live_keys(self) -> bool:
        """Whether some key is not revoked (a server without a key of its own then refuses requests
        without one: app/deps.py get_principal)."""
        ...

    def revoke_key(self, key_id: str, revoked_at: float) -> bool:
        """False when there is no such key, or it was revoked already."""
        ...


def chunk_pages(first: Any, last: Any) -> tuple[int, int] | None:
    """(first, last) page from a chunk's metadata; a document stored before chunk_last_pages has its first only."""
    if not isinstance(first, int) or isinstance(first, bool):
        return None
    return (first, last if isinstance(last, int) and not isinstance(last, bool) and last >= first else first)


def rows_of_ranking(store: DocumentStore, ranked: Sequence[tuple[int, float]], dense: Collection[int]) -> list[FusedHit]:
    """`DocumentStore.fused_rows` by the store's own calls: the ranked chunks' rows, and the embeddings of
    those the dense ranking did not hold. A chunk gone between the rankings and the rows is left out."""
    chunks = store.chunks_by_row_ids([row_id for row_id, _ in ranked])
    unscored = [row_id for row_id, _ in ranked if row_id not in dense and row_id in chunks]
    batch = store.embeddings_of(unscored) if unscored else None
    vectors = {} if batch is None else dict(zip(batch.row_ids.tolist(), batch.vectors))
    return [FusedHit(chunks[row_id], score, vectors.get(row_id)) for row_id, score in ranked if row_id in chunks]


def entry_name_hits(names: Sequence[str], found: dict[str, list[tuple[int, str, str | None]]],
                    limit: int) -> dict[str, list[int]]:
    """`DocumentStore.name_hits`'s result from each name's chunks as (row id, document id, title), at most
    `limit` + 1 of them read. A name that a chunk's document is called by ("nsswitch.conf" in
    "nsswitch.conf.5.txt", "UPower.conf") says which document, not which entry of it: left out, as is a
    name in more than `limit` chunks or in none."""
    hits: dict[str, list[int]] = {}
    for name in names:
        rows = found.get(name, [])
        called = [(doc_id + " " + (title or "")).lower() for _, doc_id, title in rows]
        if 0 < len(rows) <= limit and not any(name.lower() in c for c in called):
            hits[name] = sorted(row_id for row_id, _, _ in rows)
    return hits
