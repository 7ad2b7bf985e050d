"""Request and response models of /v1/keys."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from app.auth.principal import Role
from retrieval.store_types import COLLECTION_NAME_PATTERN

KEY_ID_PATTERN = r"^[0-9a-f]{12}$"


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("", max_length=200, description="What the key is for (shown in the list).")
    role: Role = Field(..., description="read (ask, list and read documents), write (also ingest and delete "
                       "documents) or admin (also change and delete its collections).")
    collections: list[Annotated[str, Field(pattern=COLLECTION_NAME_PATTERN)]] = Field(
        ..., min_length=1, max_length=1000, description="The collections it may use; every other reads as not found.")


class KeyOut(BaseModel):
    id: str
    name: str
    role: Role
    collections: list[str] = Field(description="Those that still exist (a deleted collection's grant goes with it).")
    created_at: float
    revoked_at: float | None = None


class KeyCreated(KeyOut):
    key: str = Field(description="The token, for 'Authorization: Bearer <key>': shown this once, stored only as "
                     "its hash.")


class KeyList(BaseModel):
    keys: list[KeyOut]


class KeyRevoked(BaseModel):
    id: str
    revoked: bool
