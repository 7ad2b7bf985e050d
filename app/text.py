"""Checks on user text shared by the request models."""

from __future__ import annotations

import unicodedata

# Unicode categories that show nothing: controls (NUL, ...) and format characters (zero-width space,
# joiners, BOM, ...). Text made only of these and whitespace is blank however long it is.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf"})


def is_blank(text: str) -> bool:
    """True when `text` has no visible character (stops at the first one, so long texts are cheap)."""
    return all(ch.isspace() or unicodedata.category(ch) in _INVISIBLE_CATEGORIES for ch in text)


# NUL (U+0000): Postgres text and JSONB cannot hold it (psycopg refuses it, a 500 once at the store), so
# text bound for the document store is refused with it at validation, or has it dropped where it was
# extracted from a file: the same answer on SQLite and on Postgres.
NUL = "\x00"
NUL_MESSAGE = "contains a NUL character (\\u0000), which the document store cannot hold"


def without_nul(text: str) -> str:
    return text.replace(NUL, "")


def nul_location(value: object, where: str) -> str | None:
    """Where the first NUL is in a JSON value's strings, object keys included ('metadata.tags[1].note'),
    or None. Iterative: a deeply nested value cannot exhaust the stack."""
    stack = [(where, value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if NUL in item:
                return where
        elif isinstance(item, dict):
            for key, child in item.items():
                if NUL in key:
                    return f"{where} (a key)"
                stack.append((f"{where}.{key}", child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item))
    return None
