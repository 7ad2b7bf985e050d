"""Document ids derived from names (an uploaded file's name, a path under `ragblend ingest`'s argument).

A name that is already a valid id (`report.pdf`, `a:notes`) is its own id. Any other name is cleaned
(unsafe characters to '-', leading '._:-' dropped, cut to fit) *and* tagged with a hash of the whole
original name, so cleaning never maps two different names to one id: `my notes.pdf` and `my-notes.pdf`
stay two documents (`my-notes-1f0c...pdf` and `my-notes.pdf`), as do `\\xff\\xfe.txt` and `   .txt`. The
suffix is kept through the cut, so a long name keeps its extension.
"""

from __future__ import annotations

import hashlib
import re

MAX_ID_CHARS = 128  # DOCUMENT_ID_PATTERN's limit
NUM_TAG_CHARS = 10  # hex digits of the name's sha256: 40 bits, collisions only by brute force
_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_UNSAFE_IN_PART = re.compile(r"[^A-Za-z0-9._-]")  # ':' joins path parts, so a part may not hold one
_LEADING = "._:-"


def _tag(original: str) -> str:
    # surrogateescape: a file name that is not UTF-8 (b'\xff\xfe.txt') still hashes to its own bytes
    return hashlib.sha256(original.encode("utf-8", "surrogateescape")).hexdigest()[:NUM_TAG_CHARS]


def _tagged(cleaned: str, suffix: str, original: str) -> str:
    room = MAX_ID_CHARS - NUM_TAG_CHARS - len(suffix) - 1
    cleaned = cleaned[:max(room, 0)].rstrip("-")
    # the hex tag starts with [0-9a-f], so an id made of the tag alone is still valid
    return f"{cleaned}-{_tag(original)}{suffix}" if cleaned else f"{_tag(original)}{suffix}"


def _derive(name: str, suffix: str, unsafe: re.Pattern) -> str:
    original = name + suffix
    clean_suffix = unsafe.sub("-", suffix)
    cleaned = unsafe.sub("-", name).lstrip(_LEADING)
    if cleaned + clean_suffix == original and cleaned and len(original) <= MAX_ID_CHARS:
        return original
    return _tagged(cleaned, clean_suffix, original)


def id_from_file_name(name: str, suffix: str = "") -> str:
    """The id of a file's base name `name` + `suffix` (the suffix, e.g. '.pdf', is kept whole at the end).
    ':' counts as unsafe here: it joins the folders of `ragblend ingest`'s ids, which a name cannot fake."""
    return _derive(name, suffix, _UNSAFE_IN_PART)


def id_from_value(value: str) -> str:
    """A given id (a JSONL line's) as it is when valid, else cleaned and tagged."""
    return _derive(value, "", _UNSAFE)


def id_from_parts(parts: list[str], suffix: str = "") -> str:
    """The id of a relative path's folders and stem, joined by ':' (`a/notes` -> `a:notes`)."""
    original = "/".join(parts) + suffix
    cleaned_parts = [_UNSAFE_IN_PART.sub("-", part) for part in parts]
    joined = ":".join(cleaned_parts).lstrip(_LEADING)
    clean_suffix = _UNSAFE.sub("-", suffix)
    is_lossless = (cleaned_parts == parts and joined == ":".join(parts) and all(parts)
                   and clean_suffix == suffix and len(joined + suffix) <= MAX_ID_CHARS)
    return joined + suffix if is_lossless and joined else _tagged(joined, clean_suffix, original)
