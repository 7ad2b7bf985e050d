"""`extract_file(name, data, limits)`: the file's format from its extension, checked against its
bytes, then the format's extractor. Every refusal is a FileRejected naming the file."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from pathlib import PurePath
from typing import Sequence

from app.documents.ids import id_from_file_name, id_from_value
from app.extract.text import decode_text, first_line_title, markdown_title, parse_jsonl
from app.extract.types import SUFFIX_FORMATS, ExtractedDocument, ExtractionLimits, FileFormat, FileRejected
from app.text import without_nul
from retrieval.chunker import PAGE_BREAK

_ZIP_MAGIC, _PDF_MAGIC = b"PK\x03\x04", b"%PDF-"
MAX_TITLE_CHARS = 512  # DocumentIn.title's limit


def file_format(name: str) -> FileFormat:
    suffix = PurePath(name).suffix.lower()
    if suffix not in SUFFIX_FORMATS:
        known = ", ".join(sorted(SUFFIX_FORMATS))
        raise FileRejected(f"{name}: unsupported file type {suffix or '(no extension)'!r}; supported: {known}")
    return SUFFIX_FORMATS[suffix]


def document_id(name: str) -> str:
    """A document id from a file name: the base name when it is a valid id ('report.pdf'; re-uploading
    replaces it), else cleaned and tagged with the name's hash ('My report.pdf' -> 'My-report-<hash>.pdf'),
    so two different names never share an id (app/documents/ids.py)."""
    base = PurePath(PurePath(name.replace("\\", "/")).name)
    return id_from_file_name(base.stem if base.suffix else base.name, base.suffix)


def extract_file(name: str, data: bytes, limits: ExtractionLimits, doc_id: str | None = None) -> list[ExtractedDocument]:
    """`doc_id`: the id the client chose for the file (a JSONL file's lines without an id get `<doc_id>:<n>`);
    None: from the file's name."""
    fmt = file_format(name)
    if not data.strip():
        raise FileRejected(f"{name}: the file is empty")
    _check_magic(name, data, fmt)
    # NULs dropped from extracted text (the store cannot hold them; a PDF's pages lose theirs before
    # they are joined, so its page offsets hold); a JSONL line's metadata keeps them: its 422 names them
    docs = [replace(doc, title=_clean_title(doc.title), text=without_nul(doc.text))
            for doc in _extract(name, data, fmt, limits, doc_id or document_id(name))]
    for doc in docs:
        if not doc.text.strip():
            raise FileRejected(f"{name}: no text found in the file")
        if len(doc.text) > limits.max_document_chars:
            raise FileRejected(
                f"{name}: {len(doc.text)} characters of text; the limit is {limits.max_document_chars}",
                is_too_large=True,
            )
    return docs


def _clean_title(title: str | None) -> str | None:
    """One line, at most MAX_TITLE_CHARS (a PDF's Title can be anything)."""
    return " ".join(without_nul(title or "").split())[:MAX_TITLE_CHARS] or None


def _check_magic(name: str, data: bytes, fmt: FileFormat) -> None:
    """A PDF must start like one, a DOCX must be a zip, and a text format must be neither."""
    head = data[:1024].lstrip()
    if fmt is FileFormat.PDF and _PDF_MAGIC not in data[:1024]:
        raise FileRejected(f"{name}: not a PDF (no %PDF- header); is the extension right?")
    if fmt is FileFormat.DOCX and not data.startswith(_ZIP_MAGIC):
        raise FileRejected(f"{name}: not a DOCX file (not a zip archive); is the extension right?")
    if fmt not in (FileFormat.PDF, FileFormat.DOCX) and head.startswith((_PDF_MAGIC, _ZIP_MAGIC)):
        kind = "a PDF" if head.startswith(_PDF_MAGIC) else "a zip archive (DOCX?)"
        raise FileRejected(f"{name}: the content is {kind}, not {fmt.value}; is the extension right?")


def _extract(name: str, data: bytes, fmt: FileFormat, limits: ExtractionLimits, doc_id: str) -> list[ExtractedDocument]:
    base = {"source": without_nul(PurePath(name).name), "format": fmt.value}
    # each format's parser is imported with its first file: pypdf, python-docx and trafilatura with
    # theirs hold ~20 MB a server that never sees one needs not (docs/benchmarks/memory.md)
    if fmt is FileFormat.PDF:
        from app.extract.pdf import extract_pdf

        title, pages, warnings = extract_pdf(name, data)
        text, starts = join_pages(pages)
        return [ExtractedDocument(doc_id, title or first_line_title(text), text, fmt,
                                  {**base, "num_pages": len(pages)}, starts, tuple(warnings))]
    if fmt is FileFormat.DOCX:
        from app.extract.docx import extract_docx, unzip_bounded

        title, text = extract_docx(name, unzip_bounded(name, data, limits.max_unzipped_bytes))
        return [ExtractedDocument(doc_id, title or first_line_title(text), text, fmt, base)]
    if fmt is FileFormat.HTML:
        from app.extract.html import decode_html, extract_html

        markup = decode_html(data)
        if markup is None:
            raise FileRejected(f"{name}: not decodable HTML (neither UTF-8 nor its declared charset)")
        title, text = extract_html(markup)
        return [ExtractedDocument(doc_id, title or first_line_title(text), text, fmt, base)]
    text = decode_text(name, data)
    if fmt is FileFormat.JSONL:
        return [_jsonl_document(row, doc_id, number, base) for number, row in
                enumerate(parse_jsonl(name, text, limits.max_documents))]
    title = markdown_title(text) if fmt is FileFormat.MARKDOWN else first_line_title(text)
    return [ExtractedDocument(doc_id, title, text.strip(), fmt, base)]


def _jsonl_document(row: dict, file_id: str, number: int, base: dict) -> ExtractedDocument:
    metadata = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
    doc_id = row["id"] if isinstance(row.get("id"), str) and row["id"] else f"{file_id}:{number}"
    title = row["title"] if isinstance(row.get("title"), str) else None
    return ExtractedDocument(id_from_value(doc_id), title, row["text"].strip(), FileFormat.JSONL, {**base, **metadata})


def join_pages(pages: Sequence[str]) -> tuple[str, tuple[int, ...]]:
    """The pages' text joined by page breaks (a form feed on a line of its own: `structure` chunking never
    crosses one), and the offset where each page starts in it."""
    text, starts = "", []
    for page in pages:
        starts.append(len(text))
        text += page + "\n" + PAGE_BREAK + "\n"
    return text.rstrip(), tuple(starts)


def page_at(page_starts: Sequence[int], offset: int) -> int:
    """The 1-based page holding character `offset`."""
    return max(1, bisect_right(page_starts, offset))
