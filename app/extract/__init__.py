"""Text extraction from uploaded files: PDF, HTML, DOCX, Markdown, plain text and JSONL."""

from app.extract.dispatch import extract_file
from app.extract.types import ExtractedDocument, ExtractionLimits, FileFormat

__all__ = ["ExtractedDocument", "ExtractionLimits", "FileFormat", "extract_file"]
