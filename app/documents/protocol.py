"""Request and response models of /v1/documents."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator

from app.text import is_blank
from configs.settings import ChunkingMode

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
        return value


class IngestRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    documents: list[DocumentIn] = Field(..., min_length=1)
    chunking: ChunkingMode | None = Field(None, description="tokens (default) or none: one passage, one chunk.")
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
    status: DocumentStatus
    chunks: list[ChunkOut]
    kv_pending: bool = Field(
        False, description="Its chunks' KV is being computed in the background (a large document): kv_cached "
        "fills in, see GET /v1/documents/{id}; meanwhile questions recompute those chunks.",
    )


class IngestResponse(BaseModel):
    documents: list[DocumentOut] = Field(..., description="Every document of the request, committed, in order.")


class DocumentDetail(BaseModel):
    id: str
    title: str | None
    metadata: dict[str, Any]
    num_chars: int
    created_at: float
    chunks: list[ChunkDetail]


class DocumentSummary(BaseModel):
    id: str
    title: str | None
    num_chunks: int
    num_chars: int
    created_at: float


class DocumentList(BaseModel):
    documents: list[DocumentSummary]
    total: int


class DeleteResponse(BaseModel):
    id: str
    deleted: bool
    num_chunks: int
