"""What extraction returns, its limits, and the formats it knows."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from app.config import LimitsConfig


class FileFormat(str, Enum):
    PDF = "pdf"
    HTML = "html"
    DOCX = "docx"
    MARKDOWN = "markdown"
    TEXT = "text"
    JSONL = "jsonl"


SUFFIX_FORMATS: dict[str, FileFormat] = {
    ".pdf": FileFormat.PDF,
    ".html": FileFormat.HTML,
    ".htm": FileFormat.HTML,
    ".docx": FileFormat.DOCX,
    ".md": FileFormat.MARKDOWN,
    ".markdown": FileFormat.MARKDOWN,
    ".txt": FileFormat.TEXT,
    ".text": FileFormat.TEXT,
    ".jsonl": FileFormat.JSONL,
}


@dataclass(frozen=True)
class ExtractionLimits:
    """The configured limits (`limits.*`) extraction enforces: built from them (app/uploads/serving.py)."""

    max_document_chars: int  # extracted text per document (413 above)
    max_unzipped_bytes: int  # a DOCX's members, uncompressed (zip bombs: 413 above)
    max_documents: int  # documents from one file (JSONL lines)

    @classmethod
    def of(cls, limits: LimitsConfig) -> ExtractionLimits:
        return cls(limits.max_document_chars, limits.max_unzipped_bytes, limits.max_documents_per_request)


@dataclass(frozen=True)
class ExtractedDocument:
    """One document out of a file. `page_starts[i]`: offset in `text` where PDF page i+1 begins."""

    id: str
    title: str | None
    text: str
    file_format: FileFormat
    metadata: dict[str, Any] = field(default_factory=dict)
    page_starts: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()  # what of the file is not in `text` (a PDF's blank or unreadable pages)


def reason(exc: BaseException) -> str:
    """What a parser said was wrong with a file, for its 422: the message, never the parser's class name."""
    text = " ".join(str(exc).split())[:300]
    return text or "damaged or unsupported content"


class FileRejected(Exception):
    """A file that cannot be ingested; the message names it. `is_too_large` maps to 413, else 422."""

    def __init__(self, message: str, is_too_large: bool = False):
        super().__init__(message)
        self.message, self.is_too_large = message, is_too_large
