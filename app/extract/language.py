"""What a document's language is, roughly: enough to warn that the packaged embedder (all-MiniLM-L6-v2,
trained on English) will rank its passages poorly. By stop words (jusText's lists, 100 languages): the
language whose stop words make the largest share of the text's words, when they make a fair share of it.
Configuration files, code and tables have few stop words in any language: no verdict, no warning."""

from __future__ import annotations

import functools
import re
from collections import Counter

import justext

_WORD = re.compile(r"[^\W\d_]+")
SAMPLE_WORDS = 3000  # the first words decide: a document's language rarely changes midway
MIN_WORDS = 40  # fewer words: no verdict
MIN_SHARE = 0.2  # prose has 30-50% stop words; lists, code and configuration files far fewer


@functools.cache
def _stoplists() -> dict[str, frozenset[str]]:
    """English's stop words, and each other language's own: jusText's lists come from Wikipedia, and some
    (Marathi's, Hindi's) hold English words, which must not make English text read as those languages."""
    english = frozenset(justext.get_stoplist("English"))
    return {name: english if name == "English" else frozenset(justext.get_stoplist(name)) - english
            for name in sorted(justext.get_stoplists())}


def main_language(text: str) -> str | None:
    """The name of the text's language (jusText's: "English", "German", ...), or None when its words
    are too few or not prose. English when its stop words make a fair share of the text."""
    words = [w.lower() for w in _WORD.findall(text[: SAMPLE_WORDS * 12])][:SAMPLE_WORDS]
    if len(words) < MIN_WORDS:
        return None
    counts: Counter[str] = Counter()
    languages = _languages_of()
    for word in words:
        counts.update(languages.get(word, ()))
    if counts["English"] >= MIN_SHARE * len(words):
        return "English"
    best = max(counts, key=lambda name: counts[name], default=None)
    return best if best is not None and counts[best] >= MIN_SHARE * len(words) else None


@functools.cache
def _languages_of() -> dict[str, tuple[str, ...]]:
    """Stop word -> the languages it is a stop word of (one look-up per word of a text)."""
    out: dict[str, list[str]] = {}
    for name, words in _stoplists().items():
        for word in words:
            out.setdefault(word, []).append(name)
    return {word: tuple(names) for word, names in out.items()}


def language_warning(text: str, embedder: str, english_only_embedders: frozenset[str]) -> str | None:
    """A warning for a document an English-only embedder will rank poorly; None when it reads as English,
    has no verdict, or the embedder is not English-only."""
    if embedder.lower() not in english_only_embedders:
        return None
    language = main_language(text)
    if language is None or language == "English":
        return None
    return (f"the text looks like {language}, not English: the embedder ({embedder}) was trained on English, so "
            f"dense retrieval may miss its passages (lexical and hybrid retrieval match its words; ask in "
            f"{language}, or set retrieval.embedder to a multilingual model)")
