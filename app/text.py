"""Checks on user text shared by the request models."""

from __future__ import annotations

import unicodedata

# Unicode categories that show nothing: controls (NUL, ...) and format characters (zero-width space,
# joiners, BOM, ...). Text made only of these and whitespace is blank however long it is.
_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf"})


def is_blank(text: str) -> bool:
    """True when `text` has no visible character (stops at the first one, so long texts are cheap)."""
    return all(ch.isspace() or unicodedata.category(ch) in _INVISIBLE_CATEGORIES for ch in text)
