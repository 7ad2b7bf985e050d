"""Split a document into chunks of the LLM's tokens, cut at paragraph or sentence boundaries."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from configs.enums import ChunkingMode

Tokenize = Callable[[str], list[int]]
Detokenize = Callable[[list[int]], str]

# A paragraph break, or a sentence end followed by whitespace.
_PIECE_END = re.compile(r"\n\s*\n|(?<=[.!?])\s+")


@dataclass(frozen=True)
class TextChunk:
    text: str
    token_ids: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class _Piece:
    text: str
    num_tokens: int


class Chunker:
    """Greedy packing of sentences into chunks of at most `max_tokens`, with `num_overlap_tokens` of
    trailing sentences repeated at the start of the next chunk. A sentence longer than a chunk is
    cut at token boundaries."""

    def __init__(self, tokenize: Tokenize, detokenize: Detokenize, max_tokens: int = 384, num_overlap_tokens: int = 32):
        if max_tokens < 1:
            raise ValueError(f"chunk size must be >= 1 token, got {max_tokens}")
        if not 0 <= num_overlap_tokens < max_tokens:
            raise ValueError(f"overlap must be in [0, {max_tokens}), got {num_overlap_tokens}")
        self._tokenize, self._detokenize = tokenize, detokenize
        self.max_tokens, self.num_overlap_tokens = max_tokens, num_overlap_tokens

    def split(self, text: str, mode: ChunkingMode = ChunkingMode.TOKENS) -> list[TextChunk]:
        text = text.strip()
        if not text:
            return []
        if mode is ChunkingMode.NONE:
            return [self._chunk(text)]
        return [self._chunk(group) for group in self._pack(self._pieces(text))]

    def _chunk(self, text: str) -> TextChunk:
        return TextChunk(text=text, token_ids=tuple(self._tokenize(text)))

    def _pieces(self, text: str) -> list[_Piece]:
        pieces: list[_Piece] = []
        for sentence in _split_keep_ends(text):
            token_ids = self._tokenize(sentence)
            if len(token_ids) <= self.max_tokens:
                pieces.append(_Piece(sentence, len(token_ids)))
                continue
            for start in range(0, len(token_ids), self.max_tokens):  # an over-long sentence: cut by tokens
                part = token_ids[start : start + self.max_tokens]
                pieces.append(_Piece(self._detokenize(part), len(part)))
        return pieces

    def _pack(self, pieces: list[_Piece]) -> list[str]:
        groups: list[str] = []
        current: list[_Piece] = []
        for piece in pieces:
            if current and sum(p.num_tokens for p in current) + piece.num_tokens > self.max_tokens:
                groups.append(_join(current))
                current = self._overlap(current, budget=self.max_tokens - piece.num_tokens)
            current.append(piece)
        if current:
            groups.append(_join(current))
        return groups

    def _overlap(self, pieces: list[_Piece], budget: int) -> list[_Piece]:
        """The trailing pieces of the previous chunk that fit in the overlap (and beside the next piece)."""
        kept: list[_Piece] = []
        num_tokens = 0
        for piece in reversed(pieces):
            num_tokens += piece.num_tokens
            if num_tokens > min(self.num_overlap_tokens, budget):
                break
            kept.insert(0, piece)
        return kept


def _split_keep_ends(text: str) -> list[str]:
    """Sentences and paragraphs, each keeping the whitespace after it (so joins restore the text)."""
    parts, start = [], 0
    for match in _PIECE_END.finditer(text):
        parts.append(text[start : match.end()])
        start = match.end()
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


def _join(pieces: list[_Piece]) -> str:
    return "".join(piece.text for piece in pieces).strip()
