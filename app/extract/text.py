"""Plain text, Markdown and JSONL (one document per line: {"id"?, "title"?, "text", "metadata"?})."""

from __future__ import annotations

import json
from typing import Any

from app.extract.types import FileRejected


def decode_text(name: str, data: bytes) -> str:
    """UTF-8 (a BOM is dropped) or UTF-16 with its BOM; anything else, or NUL bytes, is not text."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        encoding = "utf-16"
    else:
        encoding = "utf-8-sig"
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as exc:
        raise FileRejected(f"{name}: not UTF-8 text (byte {exc.start}); is the extension right?") from exc
    if "\x00" in text:
        raise FileRejected(f"{name}: contains NUL bytes: a binary file, not text; is the extension right?")
    return text


def first_line_title(text: str) -> str | None:
    """The first non-empty line, without Markdown's heading marks."""
    line = next((line for line in text.splitlines() if line.strip()), "")
    return line.lstrip("#").strip()[:200] or None


def markdown_title(text: str) -> str | None:
    """The first '# ' heading (front matter skipped), else the first line."""
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()[:200] or None
    return first_line_title(text)


def parse_jsonl(name: str, text: str, max_documents: int) -> list[dict[str, Any]]:
    """The lines' objects, each with a non-empty 'text'; a bad line rejects the whole file."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise FileRejected(f"{name}:{number}: not valid JSON ({exc.msg})") from exc
        if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
            raise FileRejected(f"{name}:{number}: each line must be an object with a non-empty 'text'")
        rows.append(row)
        if len(rows) > max_documents:
            raise FileRejected(f"{name}: more than {max_documents} documents; the limit is {max_documents}")
    if not rows:
        raise FileRejected(f"{name}: no documents (empty JSONL)")
    return rows
