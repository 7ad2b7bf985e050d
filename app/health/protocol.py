"""Liveness and readiness."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str = Field(description="ready; else (503) loading, measuring (the loading planner's start-up "
                                    "measurement on the engine: requests queue behind it) or failed.")
    model: str | None = None
    # Left out (not 0) where server.api_key is set: /readyz asks no key, and counts over every collection
    # are no caller's business; a 0 would tell a monitor the store is empty.
    num_documents: int | None = Field(None, description="Documents stored (only without server.api_key).")
    num_chunks: int | None = Field(None, description="Chunks stored (only without server.api_key).")
    num_indexed: int | None = Field(None, description="Chunks in the vector indexes (only without server.api_key).")
    error: str | None = None
