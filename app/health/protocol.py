"""Liveness and readiness."""

from __future__ import annotations

from pydantic import BaseModel


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    status: str
    model: str | None = None
    num_documents: int = 0
    num_chunks: int = 0
    num_indexed: int = 0
    error: str | None = None
