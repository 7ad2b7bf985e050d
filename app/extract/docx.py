"""DOCX text (python-docx): paragraphs and tables in order, headings as Markdown; zip bombs refused
before anything is decompressed."""

from __future__ import annotations

import io
import zipfile

import docx
from docx.document import Document as DocxDocument
from docx.table import Table
from docx.text.paragraph import Paragraph

from app.extract.types import FileRejected


def check_zip(name: str, data: bytes, max_unzipped_bytes: int) -> None:
    """Refuse a file that is no zip, lacks word/document.xml, or would expand past the limit."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise FileRejected(f"{name}: not a DOCX file (not a valid zip archive: {exc})") from exc
    if not any(m.filename == "word/document.xml" for m in members):
        raise FileRejected(f"{name}: not a DOCX file (no word/document.xml inside)")
    num_unzipped = sum(m.file_size for m in members)
    if num_unzipped > max_unzipped_bytes:
        raise FileRejected(
            f"{name}: the DOCX expands to {num_unzipped} bytes, over the limit of {max_unzipped_bytes} "
            "(a zip bomb?)", is_too_large=True,
        )


def extract_docx(name: str, data: bytes) -> tuple[str | None, str]:
    """(title from the core properties or the first heading, text)."""
    try:
        document = docx.Document(io.BytesIO(data))
        blocks = [_block_text(block) for block in document.iter_inner_content()]
        title = document.core_properties.title or _first_heading(document)
    except Exception as exc:  # damaged XML or parts can fail anywhere in the parser: the file's fault, not ours
        raise FileRejected(f"{name}: not a readable DOCX ({type(exc).__name__}: {exc})") from exc
    return (title or "").strip()[:512] or None, "\n\n".join(b for b in blocks if b.strip())


def _block_text(block: Paragraph | Table) -> str:
    if isinstance(block, Table):
        return "\n".join(" | ".join(cell.text.strip() for cell in row.cells) for row in block.rows)
    style = (block.style.name if block.style is not None else "") or ""
    if style.startswith("Heading") and style[len("Heading"):].strip().isdigit():
        return "#" * int(style[len("Heading"):]) + " " + block.text
    if style == "Title":
        return "# " + block.text
    return block.text


def _first_heading(document: DocxDocument) -> str | None:
    for paragraph in document.paragraphs:
        style = (paragraph.style.name if paragraph.style is not None else "") or ""
        if (style == "Title" or style.startswith("Heading")) and paragraph.text.strip():
            return paragraph.text
    return None
