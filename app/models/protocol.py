"""OpenAI's model list."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragblend"
    collection: str | None = Field(None, description="The knowledge base this name picks (none: the default one, "
                                   "or a scoped key's own).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
