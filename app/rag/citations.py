"""An answer's citations: each [n] it writes, mapped to the prompt's n-th chunk (blend_engine/prompt.py
numbers the chunks [1], [2], ... in the order of the sources). A number that names no chunk of the
prompt is dropped: it is never presented as a source."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from app.rag.types import Source

# [n], or several numbers in one bracket ([1, 3] or [1; 3]); not an index written after a name (argv[1],
# x[2]): a letter or underscore right before the bracket
CITATION = re.compile(r"(?<![A-Za-z_])\[\s*(\d{1,4}(?:\s*[,;]\s*\d{1,4})*)\s*\]")


@dataclass(frozen=True)
class Citation:
    number: int  # the n of [n]: sources[n - 1]
    source: Source


def cited_numbers(answer: str) -> list[int]:
    """The numbers the answer cites, each once, in the order first cited."""
    numbers: dict[int, None] = {}
    for match in CITATION.finditer(answer):
        for part in re.split(r"[,;]", match.group(1)):
            numbers.setdefault(int(part), None)
    return list(numbers)


def citations(answer: str, sources: Sequence[Source]) -> list[Citation]:
    """The sources the answer cites, in the order first cited; numbers naming no source left out."""
    return [Citation(n, sources[n - 1]) for n in cited_numbers(answer) if 1 <= n <= len(sources)]
