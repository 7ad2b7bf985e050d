"""Reading the files `ragblend ingest` posts: one place for every format, so more can hook in.

A document id comes from the file's path relative to the argument it was found under, without the
suffix (kept for the PDF, HTML and DOCX files the server extracts), folders joined by ':'
(`docs/a/notes.txt` under `docs` is `a:notes`, `docs/a/r.pdf` is `a:r.pdf`; a file given directly is
its stem). A path that is no valid id as it is gets a hash of itself in its id (app/documents/ids.py),
and two files or lines that still claim one id are an error naming both: nothing replaces another
unseen. Empty files are skipped with a warning. Every problem is one line naming the file (and
the line, for JSONL); all are collected so a run reports them together before sending anything.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from app.commands.upload import UPLOAD_SUFFIXES, Upload
from app.documents.ids import id_from_parts
from app.text import is_blank


class InputError(Exception):
    """A file that cannot be ingested; the message is one line and names it."""


@dataclass
class Collected:
    documents: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)  # PDF, HTML, DOCX: sent as files, extracted by the server
    _origins: dict[str, str] = field(default_factory=dict)  # document id -> where it came from

    def claim(self, doc_id: object, origin: str) -> bool:
        """Claim `doc_id` for `origin`; False (and an error) when another file or line has it already."""
        if not isinstance(doc_id, str):
            return True
        if doc_id in self._origins:
            self.errors.append(f"{origin}: document id {doc_id!r} is also {self._origins[doc_id]}'s; rename one")
            return False
        self._origins[doc_id] = origin
        return True

    def add(self, doc: dict, origin: str) -> None:
        """Keep `doc`, unless its id was claimed already (by another file or line): that is an error."""
        if self.claim(doc.get("id"), origin):
            self.documents.append(doc)


def document_id(path: Path, root: Path, keep_suffix: bool = False) -> str:
    relative = path.relative_to(root) if path != root else Path(path.name)
    parts = [*relative.parent.parts, relative.stem]
    return id_from_parts(parts, relative.suffix if keep_suffix else "")


def shown(path: Path) -> str:
    """`path` as UTF-8 text a request can carry: bytes of a non-UTF-8 name become \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from exc


def read_plain(path: Path, doc_id: str, collected: Collected) -> None:
    """A .txt/.md file is one document; its title is the first heading or line."""
    text = read_text(path)
    if is_blank(text):
        collected.warnings.append(f"{path}: empty, skipped")
        return
    first = next(line for line in text.splitlines() if not is_blank(line))
    file_format = "text" if path.suffix.lower() == ".txt" else "markdown"  # as an upload's (structure chunking)
    collected.add({"id": doc_id, "title": first.lstrip("# ").strip()[:200], "text": text,
                   "metadata": {"source": shown(path), "format": file_format}}, str(path))


def read_jsonl(path: Path, doc_id: str, collected: Collected) -> None:
    """One document per line: {"id"?, "title"?, "text", "metadata"?}."""
    for number, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            collected.errors.append(f"{path}:{number}: invalid JSON: {exc.msg} (column {exc.colno})")
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
            collected.errors.append(f"{path}:{number}: each line must be an object with a string 'text'")
        elif is_blank(doc["text"]):
            collected.warnings.append(f"{path}:{number}: empty text, skipped")
        else:
            collected.add(doc, f"{path}:{number}")


def read_upload(path: Path, doc_id: str, collected: Collected) -> None:
    """A file the server extracts, sent with its id (the path's, suffix kept)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    if size == 0:
        collected.warnings.append(f"{path}: empty, skipped")
    elif collected.claim(doc_id, str(path)):
        collected.uploads.append(Upload(path, doc_id))


# suffix -> reader(path, document id, collected): add a format by adding a reader here
READERS: dict[str, Callable[[Path, str, Collected], None]] = {
    ".txt": read_plain, ".md": read_plain, ".markdown": read_plain, ".jsonl": read_jsonl,
    **{suffix: read_upload for suffix in UPLOAD_SUFFIXES},
}


def iter_files(paths: list[Path], collected: Collected) -> Iterator[tuple[Path, Path]]:
    """(file, the argument it was found under); missing paths become errors."""
    for root in paths:
        if root.is_dir():
            found = sorted(p for p in root.rglob("*") if p.suffix.lower() in READERS and p.is_file())
            if not found:
                collected.warnings.append(f"{root}: no {', '.join(sorted(READERS))} files")
            yield from ((p, root) for p in found)
        elif root.is_file():
            yield root, root
        else:
            collected.errors.append(f"{root}: no such file or directory")


def collect(paths: list[Path]) -> Collected:
    """Every document of `paths`, with the warnings and errors met on the way."""
    collected = Collected()
    for path, root in iter_files(paths, collected):
        reader = READERS.get(path.suffix.lower())
        if reader is None:
            collected.errors.append(f"{path}: unsupported file type (one of {', '.join(sorted(READERS))})")
            continue
        try:
            reader(path, document_id(path, root, keep_suffix=reader is read_upload), collected)
        except InputError as exc:
            collected.errors.append(str(exc))
    return collected
