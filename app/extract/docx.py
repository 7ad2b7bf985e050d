"""DOCX text (python-docx): paragraphs and tables in order, headings as Markdown; zip bombs refused.

The zip's directory can lie about sizes: zipfile's `read()` of a member asks zlib for up to 2 GiB in one
call and only then cuts to the declared size, so a 1.5 MB file could cost gigabytes before its CRC check
failed. `unzip_bounded` therefore reads every member itself, 64 KiB at a time, counting the bytes
actually produced and stopping at the cap, and python-docx parses a copy rebuilt from those bytes."""

from __future__ import annotations

import io
import zipfile

import docx
from docx.document import Document as DocxDocument
from docx.table import Table
from docx.text.paragraph import Paragraph

from app.extract.types import FileRejected, reason


READ_BYTES = 64 << 10  # per read of a member: zlib produces at most this much per call


def _too_large(name: str, num_bytes: int, max_unzipped_bytes: int, is_at_least: bool) -> FileRejected:
    amount = f"at least {num_bytes}" if is_at_least else str(num_bytes)
    return FileRejected(f"{name}: the DOCX expands to {amount} bytes, over the limit of {max_unzipped_bytes} "
                        "(a zip bomb?)", is_too_large=True)


def unzip_bounded(name: str, data: bytes, max_unzipped_bytes: int) -> bytes:
    """The DOCX rebuilt (stored, sizes true) from its members as actually decompressed; refuses a file that
    is no zip, lacks word/document.xml, or expands past `max_unzipped_bytes` (declared or produced)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
            if not any(m.filename == "word/document.xml" for m in members):
                raise FileRejected(f"{name}: not a DOCX file (no word/document.xml inside)")
            num_declared = sum(m.file_size for m in members)
            if num_declared > max_unzipped_bytes:
                raise _too_large(name, num_declared, max_unzipped_bytes, is_at_least=False)
            rebuilt, num_produced = io.BytesIO(), 0
            with zipfile.ZipFile(rebuilt, "w", zipfile.ZIP_STORED) as out:
                for member in members:
                    if member.is_dir():
                        continue
                    parts = []
                    with archive.open(member) as stream:
                        while block := stream.read(READ_BYTES):
                            num_produced += len(block)
                            if num_produced > max_unzipped_bytes:
                                raise _too_large(name, num_produced, max_unzipped_bytes, is_at_least=True)
                            parts.append(block)
                    out.writestr(member.filename, b"".join(parts))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, NotImplementedError, ValueError, OSError, EOFError) as exc:
        # zipfile's messages say what is wrong ("Bad CRC-32 for file ...") without naming its classes
        raise FileRejected(f"{name}: not a DOCX file (not a valid zip archive: {exc})") from exc
    return rebuilt.getvalue()


def extract_docx(name: str, data: bytes) -> tuple[str | None, str]:
    """(title from the core properties or the first heading, text)."""
    try:
        document = docx.Document(io.BytesIO(data))
        blocks = [_block_text(block) for block in document.iter_inner_content()]
        title = document.core_properties.title or _first_heading(document)
    except Exception as exc:  # damaged XML or parts can fail anywhere in the parser: the file's fault, not ours
        raise FileRejected(f"{name}: not a readable DOCX ({reason(exc)})") from exc
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
