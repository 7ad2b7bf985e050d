"""PDF text by page (pypdf): the page offsets are kept so citations can name the page."""

from __future__ import annotations

import io
import logging

from pypdf import PdfReader
from pypdf.errors import DependencyError, FileNotDecryptedError, PdfReadError

from app.extract.types import FileRejected, reason

# pypdf logs every recoverable syntax error of a damaged file as a warning; they are not ours to act on.
logging.getLogger("pypdf").setLevel(logging.ERROR)


def extract_pdf(name: str, data: bytes) -> tuple[str | None, list[str], list[str]]:
    """(title from the PDF's metadata, text of each page, warnings: a page without text or that cannot be
    read, whose content no question can find). Raises FileRejected for encrypted, unreadable or
    text-less files."""
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not _opens_without_password(reader):
            raise FileRejected(f"{name}: the PDF is encrypted (password-protected); decrypt it first")
        pages: list[str] = []
        unreadable: dict[int, str] = {}  # page number -> why
        for number, page in enumerate(reader.pages, 1):
            try:
                pages.append(_page_text(page))
            except (FileNotDecryptedError, DependencyError):
                raise
            except Exception as exc:  # one damaged page (a broken content stream): the others still count
                pages.append("")
                unreadable[number] = reason(exc)
        if pages and len(unreadable) == len(pages):
            raise FileRejected(f"{name}: not a readable PDF ({next(iter(unreadable.values()))})")
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
    warnings = [f"page {n} could not be read ({why}): its text is left out" for n, why in unreadable.items()]
    empty = [n for n, text in enumerate(pages, 1) if not text.strip() and n not in unreadable]
    if empty:
        warnings.append(f"{_pages_label(empty)} no text (blank, or a scanned image: ragblend does no OCR), so "
                        "questions cannot find what is on them")
    return title, pages, warnings


def _pages_label(numbers: list[int]) -> str:
    """'page 3 has' or 'pages 2, 5 have'."""
    if len(numbers) == 1:
        return f"page {numbers[0]} has"
    return f"pages {', '.join(map(str, numbers))} have"


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
