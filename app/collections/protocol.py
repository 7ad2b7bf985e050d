"""Request and response models of /v1/collections."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from retrieval.store_types import COLLECTION_NAME_PATTERN


class CollectionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=COLLECTION_NAME_PATTERN, description="Letters, digits, '.', '_', '-' (64 at most).")
    description: str = Field("", max_length=2000)
    shares_kv: StrictBool = Field(False, description="Share content-addressed KV with the other collections that "
                                  "share it (the same text is cached once for all of them, and each can tell by "
                                  "timing what the others cache). Default: this collection's KV is its own. Set at "
                                  "creation only.")
    kv_budget_bytes: StrictInt | None = Field(None, ge=0, description="Its own KV budget in the budgeted tier "
                                              "(null: only the store's).")


class CollectionUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    description: str | None = Field(None, max_length=2000)
    kv_budget_bytes: StrictInt | None = Field(None, ge=0, description="null removes its own budget.")
    shares_kv: StrictBool | None = Field(None, description="Set at creation only: a different value is a 422.")


class CollectionOut(BaseModel):
    name: str
    description: str
    created_at: float
    num_documents: int
    num_chunks: int
    num_tokens: int = Field(description="Tokens over its chunks (overlaps counted in each chunk).")
    kv_bytes: int = Field(description="Bytes of its chunks' KV in the budgeted tier.")
    shares_kv: bool
    kv_budget_bytes: int | None
    access: Literal["read", "write", "admin"] = Field(description="What the calling key may do with it.")


class CollectionList(BaseModel):
    collections: list[CollectionOut]


class CollectionDeleted(BaseModel):
    name: str
    deleted: bool
    num_documents: int
    num_chunks: int
