"""A collection name sent by a client: one check and one message wherever it comes from (a `collection`
field or parameter, or the model name `<model>:<collection>`), and a bounded echo of what was sent, so
that an error never repeats a 5 000-character name, nor one that a newline cuts short in a log."""

from __future__ import annotations

import re

from retrieval.store_types import COLLECTION_NAME_PATTERN

RULE = "1 to 64 letters, digits, '.', '_' or '-', the first a letter or a digit"
_NAME = re.compile(COLLECTION_NAME_PATTERN)
_SHOWN_CHARS = 64  # a valid name's length: anything longer is cut


def shown(text: str) -> str:
    """`text` quoted for an error message: escaped (repr: a newline reads `\\n`), at most 64 characters."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def name_problem(name: str) -> str | None:
    """What is wrong with `name` as a collection name, or None. fullmatch: Python's `$` would let a
    trailing newline through."""
    if _NAME.fullmatch(name):
        return None
    return f"not a collection name: {shown(name)} ({RULE})"
