"""The lexical side of retrieval: a question's words as a full-text query (SQLite FTS5; Postgres builds
its own with plainto_tsquery), and reciprocal rank fusion of rankings (dense and lexical)."""

from __future__ import annotations

import re
from typing import Hashable, Sequence, TypeVar

Key = TypeVar("Key", bound=Hashable)

_WORD = re.compile(r"\w+")
# Question words that match most chunks and say nothing of the answer: left out of the query (Postgres's
# 'english' configuration drops the same kind of words on its side). A question made only of them finds
# nothing lexically (as on Postgres): the dense ranking still answers it.
STOP_WORDS = frozenset("""
a about above after again all am an and any are as at be because been before being below between both but by
can could did do does doing down during each few for from further had has have having he her here hers him his
how i if in into is it its itself just me more most my no nor not of off on once only or other our ours out over
own same she should so some such than that the their theirs them then there these they this those through to too
under until up very was we were what when where which while who whom why will with would you your yours
s t
""".split())  # "s" and "t": what is left of "'s" and "n't" (as in Postgres's list); "s" is in most chunks


# A question word in more chunks than this share is matched only if nothing else is left: it weighs
# little in any ranking and would match thousands of chunks (both stores; docs/design/retrieval.md#lexical)
COMMON_TERM_SHARE = 0.05
# When every word is common, those in over this share are still left out unless nothing else is left:
# in most chunks, a word ranks nothing (BM25's idf under ln 2) and costs a match in each
MOST_TERM_SHARE = 0.5


def query_terms(question: str, max_terms: int = 32) -> list[str]:
    """The question's distinct words, lower case, without stop words."""
    words = dict.fromkeys(w.lower() for w in _WORD.findall(question))
    return [w for w in words if w not in STOP_WORDS][:max_terms]


# A question's tokens, as written: split at spaces and at quotes, brackets and the punctuation that ends or
# separates words, so "core.autocrlf", "systemd-timesyncd", "X11" and "OnBootSec=" stay whole
_TOKEN = re.compile(r"[^\s\"'`“”‘’()\[\]{}<>,;:!?]+")
_POSSESSIVE = re.compile(r"['’]s\b")
_PART = re.compile(r"[^\W_]+")


def named_words(question: str, max_words: int = 16, with_numbers: bool = False) -> list[str]:
    """The question's words that name something (a program, an option, a file, an acronym, a version):
    with a digit among letters ("bzip2", "X11"), two capitals or more ("CUPS", "OpenSSH"), or joined by
    ".", "_", "-", "/" or "=" ("core.autocrlf", "systemd-timesyncd"). Ordinary words, numbers and words
    merely capitalised are left out: a question's wording need not be the documents', and a capitalised
    name has other names (MuSiQue asks about "Burma" over passages saying "Myanmar"); an identifier has
    one. Distinct, as written, stop words left out. `with_numbers`: numbers too ("8080", "1.5")."""
    words: list[str] = []
    for token in _TOKEN.findall(_POSSESSIVE.sub("", question)):
        word = token.strip(".-_/=")  # a sentence's full stop, an option's dashes ("--repeat") or "="
        if not any(ch.isalpha() for ch in word):  # a number, or punctuation alone
            is_named = with_numbers and any(ch.isdigit() for ch in word)
        elif len(word) < 2 or word.lower() in STOP_WORDS:
            continue
        else:
            is_named = (any(ch.isdigit() for ch in word) or sum(ch.isupper() for ch in word) >= 2
                        or any(ch in "._-/=" for ch in word))
        if is_named and word not in words:
            words.append(word)
    return words[:max_words]


def word_parts(word: str) -> list[str]:
    """A named word's parts as both stores index them: letters and digits, lower case, stop words left out
    ("systemd-timesyncd": systemd, timesyncd; "CMAKE_BUILD_TYPE": cmake, build, type)."""
    return [p for p in dict.fromkeys(_PART.findall(word.lower())) if p not in STOP_WORDS]


def fts5_query(terms: Sequence[str]) -> str:
    """An FTS5 MATCH expression: any of the terms, each a quoted string (so no word is read as an
    operator; FTS5 tokenizes inside the quotes as it tokenized the chunks)."""
    return " OR ".join('"' + term.replace('"', '""') + '"' for term in terms)


def reciprocal_rank_fusion(rankings: Sequence[Sequence[Key]], k: int) -> list[tuple[Key, float]]:
    """(key, score) best first, score = sum over the rankings holding the key of 1 / (k + rank), rank
    from 1 (Cormack, Clarke and Buettcher, SIGIR 2009). Ties keep the order keys first appear in,
    earlier rankings first (the dense ranking, when it comes first)."""
    scores: dict[Key, float] = {}
    for ranking in rankings:
        for rank, key in enumerate(ranking, 1):
            scores[key] = scores.get(key, 0.0) + 1.0 / (k + rank)
    return sorted(scores.items(), key=lambda item: -item[1])
