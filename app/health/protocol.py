"""Liveness and readiness."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str = Field(description="ready; else (503) loading, measuring (the loading planner's start-up "
                                    "measurement on the engine: requests queue behind it) or failed.")
    model: str | None = None
    num_documents: int = 0
    num_chunks: int = 0
    num_indexed: int = 0
    error: str | None = None
