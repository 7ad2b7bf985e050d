"""HTML to text: trafilatura finds the main content (navigation, footers, cookie banners left out;
tables kept); a page where it finds none (a very short one) falls back to html2text's whole-page
conversion. README "Formats" has the measurement behind this choice."""

from __future__ import annotations

import logging
import re
from html.parser import HTMLParser

import html2text
import trafilatura

logging.getLogger("trafilatura").setLevel(logging.ERROR)  # it logs every page it finds too short

_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?([A-Za-z0-9._-]+)""", re.IGNORECASE)


def decode_html(data: bytes) -> str | None:
    """The page's text, by its BOM, UTF-8, or the charset its <meta> declares; None when none fits."""
    for encoding in ("utf-8-sig", *_declared(data)):
        try:
            return data.decode(encoding)
        except (UnicodeDecodeError, LookupError):
            continue
    return None


def _declared(data: bytes) -> list[str]:
    match = _CHARSET.search(data[:4096])
    return [match.group(1).decode("ascii")] if match else []


def extract_html(markup: str) -> tuple[str | None, str]:
    """(title from <title> or the first <h1>, text)."""
    text = trafilatura.extract(markup, include_tables=True, include_comments=False, include_images=False) or ""
    return _Titles.of(markup), (text.strip() or _whole_page(markup))


def _whole_page(markup: str) -> str:
    """Every text of the page as Markdown-like text (headings, lists, tables; no links or images)."""
    converter = html2text.HTML2Text()
    converter.body_width = 0  # no hard wrapping: the chunker cuts at sentences
    converter.ignore_links = converter.ignore_images = converter.ignore_emphasis = True
    converter.unicode_snob = True  # keep non-ASCII characters as they are
    return re.sub(r"\n{3,}", "\n\n", converter.handle(markup)).strip()


class _Titles(HTMLParser):
    """Collects the text of <title> and of the first <h1>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.title, self.h1, self._inside = "", "", None

    @classmethod
    def of(cls, markup: str) -> str | None:
        parser = cls()
        parser.feed(markup)
        parser.close()
        title = " ".join((parser.title or parser.h1).split())
        return title[:512] or None

    def handle_starttag(self, tag: str, attrs) -> None:
        if tag == "title" and not self.title or tag == "h1" and not self.h1:
            self._inside = tag

    def handle_endtag(self, tag: str) -> None:
        if tag == self._inside:
            self._inside = None

    def handle_data(self, data: str) -> None:
        if self._inside == "title":
            self.title += data
        elif self._inside == "h1":
            self.h1 += data
