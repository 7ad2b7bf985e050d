"""Response model of POST /v1/documents/files."""

from __future__ import annotations

from pydantic import BaseModel, Field

from app.documents.protocol import ChunkOut, DocumentStatus


class UploadedDocument(BaseModel):
    id: str = Field(
        description="From the file name (a JSONL line's own id, else <file>:<line>); re-uploading replaces."
    )
    collection: str
    title: str | None
    source: str = Field(description="The uploaded file's name.")
    format: str = Field(description="pdf, html, docx, markdown, text or jsonl.")
    num_pages: int | None = Field(None, description="PDFs: pages; metadata.chunk_pages[i] is chunk i's first page, "
                                 "metadata.chunk_last_pages[i] its last.")
    status: DocumentStatus = Field(description="created, replaced, or unchanged (the same content was already stored).")
    chunks: list[ChunkOut]
    warnings: list[str] = Field(
        [], description="What of the file questions cannot find (stored all the same): PDF pages with no text "
        "(blank or scanned: no OCR) or that could not be read; text in another language than the embedder's.")


class UploadResponse(BaseModel):
    documents: list[UploadedDocument]
