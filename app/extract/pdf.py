"""PDF text by page (pypdf): the page offsets are kept so citations can name the page."""

from __future__ import annotations

import io
import logging

from pypdf import PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

from app.extract.types import FileRejected, reason

# pypdf logs every recoverable syntax error of a damaged file as a warning; they are not ours to act on.
logging.getLogger("pypdf").setLevel(logging.ERROR)


def extract_pdf(name: str, data: bytes) -> tuple[str | None, list[str]]:
    """(title from the PDF's metadata, text of each page). Raises FileRejected for encrypted,
    unreadable or text-less files."""
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not _opens_without_password(reader):
            raise FileRejected(f"{name}: the PDF is encrypted (password-protected); decrypt it first")
        pages = [_page_text(page) for page in reader.pages]
        title = _title(reader)
    except FileRejected:
        raise
    except (FileNotDecryptedError, DependencyError) as exc:
        raise FileRejected(f"{name}: the PDF is encrypted and cannot be read ({exc})") from exc
    except Exception as exc:  # a damaged file can fail anywhere in the parser: it is the file's fault, not ours
        raise FileRejected(f"{name}: not a readable PDF ({reason(exc)})") from exc
    if not any(text.strip() for text in pages):
        raise FileRejected(
            f"{name}: the PDF has no extractable text ({len(pages)} page(s); scanned images need OCR, "
            "which ragblend does not do)"
        )
    return title, pages


def _opens_without_password(reader: PdfReader) -> bool:
    """Many 'encrypted' PDFs only restrict printing/copying and open with an empty user password."""
    try:
        return bool(reader.decrypt(""))
    except (DependencyError, NotImplementedError, PdfReadError):
        return False


def _page_text(page) -> str:
    text = page.extract_text() or ""
    return text.replace("\x00", "").strip()


def _title(reader: PdfReader) -> str | None:
    try:
        title = reader.metadata.title if reader.metadata else None
    except (PdfReadError, ValueError, TypeError):
        return None
    return str(title).strip() or None if title else None
