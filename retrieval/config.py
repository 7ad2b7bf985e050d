"""Retrieval's frozen configs (the settings' `retrieval` and `database` sections): the one place their
defaults live."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

from configs.enums import ChunkingMode, IndexKind

_CONFIG = ConfigDict(extra="forbid", validate_default=True)


@dataclass(frozen=True, config=_CONFIG)
class RetrievalConfig:
    embedder: Annotated[str, Field(
        description="'all-minilm-l6-v2' (packaged) or a local model dir.")] = "all-minilm-l6-v2"
    chunking: Annotated[ChunkingMode, Field(description="Default chunking of ingested documents.")] = ChunkingMode.TOKENS
    chunk_tokens: Annotated[int, Field(ge=16, le=4096, description="Target chunk size in LLM tokens.")] = 384
    chunk_overlap: Annotated[int, Field(ge=0, le=1024, description="Tokens shared by consecutive chunks.")] = 32
    index: Annotated[IndexKind, Field(description="flat (exact) or hnsw (approximate).")] = IndexKind.FLAT
    hnsw_m: Annotated[int, Field(ge=4, le=128, description="HNSW graph degree.")] = 32
    top_k: Annotated[int, Field(ge=1, le=100, description="Default number of retrieved chunks.")] = 5
    embed_batch_size: Annotated[int, Field(ge=1, le=1024, description="Sentences per embedding batch.")] = 32
    max_inline_kv_chars: Annotated[int, Field(
        ge=0, description="Documents up to this size get their chunks' KV precomputed before the ingest answers; "
        "larger ones are committed at once and their KV computed in the background, one chunk at a time between "
        "questions (kv_cached fills in).")] = 20_000


@dataclass(frozen=True, config=_CONFIG)
class DatabaseConfig:
    """The Postgres document store that server replicas share (documents, chunks, embeddings)."""

    url: Annotated[str | None, Field(
        description="postgresql://user@host:5432/db of a document store shared by server replicas (documents, "
        "chunks, embeddings; each replica's vector index follows it); unset = SQLite under the data directory. "
        "Design: docs/design/server.md#replicas.")] = None
    max_connections: Annotated[int, Field(ge=1, description="Size bound of the Postgres connection pool.")] = 8
    timeout_s: Annotated[float, Field(
        gt=0, description="Seconds a call waits for a Postgres connection before answering 503 (server "
        "down).")] = 5.0
    poll_s: Annotated[float, Field(
        gt=0, description="How often a replica polls the shared store's change log when no NOTIFY arrives (the "
        "fallback; a NOTIFY wakes it at once).")] = 1.0
