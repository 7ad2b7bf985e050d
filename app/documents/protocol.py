"""Request and response models of /v1/documents."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from app.text import NUL, NUL_MESSAGE, is_blank, nul_location
from configs.enums import ChunkingMode
from retrieval.store_types import COLLECTION_NAME_PATTERN

DOCUMENT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str | None = Field(None, pattern=DOCUMENT_ID_PATTERN, description="Re-posting an existing id replaces it.")
    title: str | None = Field(None, max_length=512)
    text: str = Field(..., min_length=1)
    metadata: dict[str, Any] | None = None

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if is_blank(value):
            raise ValueError("text is empty (only whitespace, control or zero-width characters)")
        if NUL in value:
            raise ValueError(f"text {NUL_MESSAGE}")
        return value

    @field_validator("title")
    @classmethod
    def _title_without_nul(cls, value: str | None) -> str | None:
        if value is not None and NUL in value:
            raise ValueError(f"title {NUL_MESSAGE}")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_without_nul(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        where = nul_location(value, "metadata")
        if where is not None:
            raise ValueError(f"{where} {NUL_MESSAGE}")
        return value


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[DocumentIn] = Field(..., min_length=1)
    collection: str | None = Field(None, pattern=COLLECTION_NAME_PATTERN, description="The collection (knowledge "
                                   "base) they go into; default: `default` (a key bound to one collection: that one).")
    chunking: ChunkingMode | None = Field(
        None, description="structure (the document's blocks, headings and pages), tokens (sentences) or none (one "
        "passage, one chunk); default: retrieval.chunking.")
    precompute: StrictBool = Field(True, description="Precompute every chunk's KV into the store.")


class ChunkOut(BaseModel):
    id: str
    num_tokens: int
    kv_cached: bool


class ChunkDetail(ChunkOut):
    position: int
    text: str


class DocumentStatus(str, Enum):
    """What an ingest did with a document; each is committed (durable) once reported."""

    CREATED = "created"
    REPLACED = "replaced"
    UNCHANGED = "unchanged"  # the same content was already stored: nothing redone (re-sends are safe)


class DocumentOut(BaseModel):
    id: str
    collection: str
    status: DocumentStatus
    chunks: list[ChunkOut]
    kv_pending: bool = Field(
        False, description="Its chunks' KV is being computed in the background (a large document): kv_cached "
        "fills in, see GET /v1/documents/{id}; meanwhile questions recompute those chunks.",
    )
    warnings: list[str] = Field(
        [], description="What may keep questions from finding its content (stored all the same): text in another "
        "language than the embedder's; an upload's blank or unreadable PDF pages.")


class IngestResponse(BaseModel):
    documents: list[DocumentOut] = Field(..., description="Every document of the request, committed, in order.")


class DocumentDetail(BaseModel):
    id: str
    collection: str
    title: str | None
    metadata: dict[str, Any]
    num_chars: int
    created_at: float
    chunks: list[ChunkDetail]
    kv_bytes: int = Field(0, description="Bytes of its chunks' KV held under the collection's KV budget.")
    kv_cached_share: float = Field(0.0, description="Share of its chunks with KV now (the rest are computed "
                                   "when used, and cached once they earn it).")


class DocumentSummary(BaseModel):
    id: str
    collection: str
    title: str | None
    num_chunks: int
    num_chars: int
    created_at: float
    kv_bytes: int = Field(0, description="Bytes of its chunks' KV held under the collection's KV budget.")
    kv_cached_share: float = Field(0.0, description="Share of its chunks whose KV the budgeted tier holds.")


class CollectionKV(BaseModel):
    """The listed collections' KV: what all of it would need, and what the budget holds of it."""

    num_tokens: int = Field(..., description="Tokens over every chunk (overlaps counted per chunk).")
    bytes_per_token: float = Field(..., description="Bytes at rest per token: the mean of the entries written, "
                                   "else the storage format's nominal size.")
    estimated_full_bytes: int = Field(..., description="KV bytes the whole collection would need (an estimate).")
    cached_bytes: int = Field(..., description="KV bytes of these collections' chunks held under the budget now.")
    budget_bytes: int | None = Field(..., description="The budget: the collection's own (one collection listed, "
                                     "with one), else the disk tier's bound (memory's without disk).")


class DocumentList(BaseModel):
    documents: list[DocumentSummary]
    total: int
    collections: list[str] = Field(default_factory=list, description="The collections listed.")
    kv: CollectionKV | None = Field(None, description="Their KV need and budget (none: no bounded tier).")


class DeleteResponse(BaseModel):
    id: str
    collection: str
    deleted: bool
    num_chunks: int
