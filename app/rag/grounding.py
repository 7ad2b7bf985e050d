"""What an answer states that none of its sources holds: the numbers and names (identifiers, paths,
options, acronyms) in the answer that appear neither in the prompt's chunks nor in the question or the
chat's earlier messages. A small model asked about something the documents are near but silent on
answers with a value it makes up ("the zstd command uses `zstd_compression_level`"); the value is in no
chunk, and the answer then carries a warning saying so. Ordinary words are not checked: an answer may say
in its own words what a chunk says, while a number or an identifier has one spelling."""

from __future__ import annotations

from typing import Iterable

from app.rag.citations import CITATION
from app.rag.types import RagContext
from retrieval.lexical import named_words

MAX_TERMS = 64  # an answer's numbers and names checked (a runaway answer lists hundreds)


def unsupported_terms(answer: str, texts: Iterable[str]) -> list[str]:
    """The answer's numbers and named words (as written, each once, in order) found in none of `texts`,
    compared without case as whole words: a name with neither a letter nor a digit next to it; a number
    with no digit next to it ("10" is held by "v10" and "10.5", not by "100" or "1.10")."""
    # [n] cites a chunk; Markdown's emphasis marks are not part of what they wrap ("**v1.0.0**")
    terms = named_words(CITATION.sub(" ", answer).replace("*", " "), max_words=MAX_TERMS, with_numbers=True)
    if not terms:
        return []
    haystack = "\n".join(texts).lower()
    return [t for t in terms if not _holds(haystack, t.lower())]


def _holds(haystack: str, term: str) -> bool:
    """`term` in `haystack` as a whole word; by str.find, not a regular expression per term: the answer's
    terms are looked up in the prompt's text after the last token, and a search per term over ~15 KB cost
    ~0.4 ms (an answer of 64 terms: 24 ms; by find: 0.7 ms)."""
    is_number = not any(ch.isalpha() for ch in term)
    start = haystack.find(term)
    while start != -1:
        end = start + len(term)
        before = haystack[start - 1] if start > 0 else " "
        after = haystack[end] if end < len(haystack) else " "
        if is_number:  # no digit next to it, nor a digit and a point before it ("1.10" does not hold "10")
            is_whole = not (before.isdigit() or after.isdigit()
                            or (before == "." and start > 1 and haystack[start - 2].isdigit()))
        else:
            is_whole = not (before.isalnum() or after.isalnum())
        if is_whole:
            return True
        start = haystack.find(term, start + 1)
    return False


def unsupported_in(context: RagContext, answer: str) -> list[str]:
    """`unsupported_terms` of an answer the model wrote over `context` (none when the check is off, or
    when no model answered: nothing relevant was retrieved)."""
    if not context.is_support_checked or context.is_nothing_relevant:
        return []
    return unsupported_terms(answer, [s.text for s in context.sources] + list(context.asked))


def unsupported_warnings(terms: list[str]) -> list[str]:
    """The warning an answer with unsupported terms carries (none without)."""
    if not terms:
        return []
    return ["the answer states " + ", ".join(f"'{t}'" for t in terms) + ", which no source (nor the question) "
            "contains: it may be made up; check it against the documents"]
