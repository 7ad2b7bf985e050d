"""Split a document into chunks of the LLM's tokens.

Two ways (`retrieval.chunking`):
- `tokens`: greedy packing of sentences, cut at paragraph or sentence boundaries, with overlap;
- `structure`: the document's own blocks, packed whole while they fit. A page break (form feed, which
  PDF extraction puts between pages) is never crossed, so a PDF chunk's page is exact; a heading (a
  Markdown `#` line, or a man page's ALL-CAPS section line in text) starts a chunk unless the chunk
  before it is still under a quarter full; blank lines separate blocks (a paragraph, or a configuration
  file's comment with its settings), which stay whole when they fit. Outside Markdown, a block indented
  deeper than the one before it continues it (a man page option's further paragraphs) and goes with it
  when both fit. A block longer than a chunk is cut at its entries where it has them (outside Markdown: a
  command-line option's line "-k --keep", a "Name=" line, a comment after a setting: each entry keeps its
  description and its comment), else by sentences (with overlap), then by tokens. Every chunk is a slice
  of the document's text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from configs.enums import ChunkingMode

Tokenize = Callable[[str], list[int]]
Detokenize = Callable[[list[int]], str]

PAGE_BREAK = "\f"  # between the pages of an extracted PDF (app/extract/dispatch.py)
# A paragraph break, or a sentence end followed by whitespace.
_PIECE_END = re.compile(r"\n\s*\n|(?<=[.!?])\s+")
_BLANK_LINE = re.compile(r"\n[ \t\r\v]*\n")
_MARKDOWN_HEADING = re.compile(r"^(#{1,6})[ \t]+\S")
_FENCE = re.compile(r"^[ \t]{0,3}(```|~~~)")
# A man page's or a manual's section line: capitals (and digits, spaces, a little punctuation) alone on a
# line, e.g. "DESCRIPTION", "EXIT STATUS", "SEE ALSO". A configuration line (KEY=value) has '=' or ':'.
_CAPS_HEADING = re.compile(r"^[A-Z][A-Z0-9 &/(),'-]{2,48}$")
# A line starting an entry of a reference text (outside Markdown): a command-line option ("-k --keep",
# "--synchronous", "-# --fast"; not "-- text"), or a "Name=" setting as man pages list them ("LineMax=",
# "Storage=volatile"). A comment line after a setting line starts one too (`_entry_starts`).
_ENTRY_LINE = re.compile(r"^(?:--?[A-Za-z0-9#]|[A-Za-z][\w.-]*=)")
_COMMENT_LINE = re.compile(r"^[#;]")
# A section smaller than this share of a chunk does not end its chunk at the next heading: man pages'
# NAME and SYNOPSIS are a line or two each, and a chunk per line would cost a KV entry per line.
_MIN_FILL = 4


@dataclass(frozen=True)
class TextChunk:
    text: str
    token_ids: tuple[int, ...]
    page: int | None = None  # `structure`: the 0-based page (text between page breaks) holding the chunk

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class _Piece:
    text: str
    num_tokens: int


@dataclass(frozen=True)
class _Block:
    """A unit `structure` chunking keeps whole: a paragraph, a config block, a heading line; a slice of
    its page's text, without the white space around it."""

    start: int
    end: int
    heading_level: int | None  # a heading: 1 (highest) to 6 (a man page's section line: 1); None: body text
    indent: int = 0  # its first line's leading white space, tabs to 8 columns (outside Markdown: see _units)


class Chunker:
    """Chunks of at most `max_tokens` (a sentence or block is measured alone, so a chunk can exceed it
    by the token or two its joins make), with `num_overlap_tokens` of trailing sentences repeated at the
    start of the next chunk where a text is cut mid-paragraph."""

    def __init__(self, tokenize: Tokenize, detokenize: Detokenize, max_tokens: int = 384, num_overlap_tokens: int = 32):
        if max_tokens < 1:
            raise ValueError(f"chunk size must be >= 1 token, got {max_tokens}")
        if not 0 <= num_overlap_tokens < max_tokens:
            raise ValueError(f"overlap must be in [0, {max_tokens}), got {num_overlap_tokens}")
        self._tokenize, self._detokenize = tokenize, detokenize
        self.max_tokens, self.num_overlap_tokens = max_tokens, num_overlap_tokens

    def split(self, text: str, mode: ChunkingMode = ChunkingMode.TOKENS, is_markdown: bool = False) -> list[TextChunk]:
        """`is_markdown`: `#` lines are headings (Markdown, and the Markdown-like text DOCX and HTML
        extraction make); else `#` lines are comments (configuration files, scripts)."""
        if not text.strip():
            return []
        if mode is ChunkingMode.STRUCTURE:  # pages counted before any stripping: an empty page is a page
            return [self._chunk(group, number) for number, page in enumerate(text.split(PAGE_BREAK))
                    for group in self._pack_blocks(page, _blocks(page, is_markdown), is_markdown)]
        text = text.strip()
        if mode is ChunkingMode.NONE:
            return [self._chunk(text)]
        return [self._chunk(group) for group in self._pack(self._pieces(text))]

    def token_ids(self, text: str) -> tuple[int, ...]:
        """A chunk's token ids: its text tokenized alone (what `split` gives each chunk)."""
        return tuple(self._tokenize(text))

    def _chunk(self, text: str, page: int | None = None) -> TextChunk:
        return TextChunk(text=text, token_ids=self.token_ids(text), page=page)

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

    def _entry_pieces(self, text: str) -> list[_Piece]:
        """A block too long for a chunk, as pieces to pack: its entries (`_entry_starts`), each whole where
        it fits a chunk, else by sentences; a block with fewer than two entries, by sentences."""
        starts = _entry_starts(text)
        if len(starts) < 2:
            return self._pieces(text)
        pieces: list[_Piece] = []
        for start, end in zip([0, *starts], [*starts, len(text)]):
            entry = text[start:end]
            if not entry.strip():
                continue
            num_tokens = len(self._tokenize(entry))
            pieces += [_Piece(entry, num_tokens)] if num_tokens <= self.max_tokens else self._pieces(entry)
        return pieces

    def _pack_blocks(self, text: str, blocks: list[_Block], is_markdown: bool) -> list[str]:
        """`text`'s blocks packed whole, in order, each chunk the slice of `text` from its first block to
        its last: a chunk ends before a block that does not fit, and before a heading once it holds a
        quarter of a chunk (smaller sections share a chunk with what follows). A heading never ends a
        chunk: it moves on with what follows it. Outside Markdown, a block and those continuing it
        (`_units`) start a new chunk together when they fit one and not the chunk so far."""
        groups: list[str] = []
        current: list[tuple[_Block, int]] = []  # (block, its tokens with the blank line after it)

        def emit(part: list[tuple[_Block, int]]) -> None:
            if part:
                groups.append(text[part[0][0].start : part[-1][0].end])

        def flush() -> list[tuple[_Block, int]]:
            """Emit the current chunk without its trailing headings, which are returned (they go on)."""
            cut = len(current)
            while cut and current[cut - 1][0].heading_level is not None:
                cut -= 1
            emit(current[:cut])
            return current[cut:]

        sizes = [len(self._tokenize(text[b.start : b.end] + "\n\n")) for b in blocks]
        unit_ends = {} if is_markdown else {first: last for first, last in _units(blocks)
                                            if sum(sizes[first : last + 1]) <= self.max_tokens}
        for i, (block, num_tokens) in enumerate(zip(blocks, sizes)):
            if i in unit_ends and current and sum(n for _, n in current) + sum(sizes[i : unit_ends[i] + 1]) > self.max_tokens:
                current = flush()  # the entry and its continuation move on together
            used = sum(n for _, n in current)
            has_body = any(b.heading_level is None for b, _ in current)
            if block.heading_level is not None and has_body and used * _MIN_FILL >= self.max_tokens:
                current = flush()
                used = sum(n for _, n in current)
            if num_tokens > self.max_tokens:  # cut by sentences, its headings leading the first part
                headings = flush()
                start = headings[0][0].start if headings else block.start
                cut = text[start : block.end]
                groups += self._pack(self._pieces(cut) if is_markdown else self._entry_pieces(cut))
                current = []
                continue
            if current and used + num_tokens > self.max_tokens:
                current = flush()
            current.append((block, num_tokens))
        emit(current)
        return groups


def _blocks(text: str, is_markdown: bool) -> list[_Block]:
    """The text's blocks in order, each a slice of `text` without its surrounding white space:
    separated by blank lines; a heading line is a block of its own. Markdown's fenced code is body text
    whatever its lines look like (a `#` comment, blank lines)."""
    blocks: list[_Block] = []
    body_start: int | None = None  # where the open body block starts
    body_end = body_indent = 0
    is_fenced = False

    def close() -> None:
        nonlocal body_start
        if body_start is not None:
            blocks.append(_Block(body_start, body_end, None, body_indent))
        body_start = None

    offset = 0
    for line in text.split("\n"):
        line_start, line_end = offset, offset + len(line)
        offset = line_end + 1
        stripped = line.strip()
        is_fence = is_markdown and _FENCE.match(line) is not None
        if not is_fenced and not is_fence:
            if not stripped:
                close()
                continue
            level = _heading_level(stripped, is_markdown)
            if level is not None:
                close()
                lead = len(line) - len(line.lstrip())
                blocks.append(_Block(line_start + lead, line_start + lead + len(stripped), level))
                continue
        if is_fence:
            is_fenced = not is_fenced
        if body_start is None:
            body_start = line_start + len(line) - len(line.lstrip())
            body_indent = len(line.expandtabs(8)) - len(line.expandtabs(8).lstrip())
        body_end = line_start + len(line.rstrip())
    close()
    return blocks


def _units(blocks: list[_Block]) -> list[tuple[int, int]]:
    """(first, last) indexes of the runs of body blocks in which every block after the first is indented
    deeper than the first: an entry and its continuation (a man page's option line with its description,
    then that description's further paragraphs). Runs of one block are left out."""
    units: list[tuple[int, int]] = []
    first = 0
    for i in range(1, len(blocks) + 1):
        is_continuation = (i < len(blocks) and blocks[i].heading_level is None and blocks[first].heading_level is None
                           and blocks[i].indent > blocks[first].indent)
        if not is_continuation:
            if i - 1 > first:
                units.append((first, i - 1))
            first = i
    return units


def _entry_starts(text: str) -> list[int]:
    """Offsets in `text` (a block) of the lines starting an entry, the first line excepted: a command-line
    option's or a "Name=" line (`_ENTRY_LINE`), or a comment line after a line that is not one (a
    configuration file's next setting's comment)."""
    starts: list[int] = []
    offset = 0
    previous_is_comment = True
    for line in text.split("\n"):
        stripped = line.lstrip()
        is_comment = _COMMENT_LINE.match(stripped) is not None
        if offset and stripped and (_ENTRY_LINE.match(stripped) or (is_comment and not previous_is_comment)):
            starts.append(offset)
        if stripped:
            previous_is_comment = is_comment
        offset += len(line) + 1
    return starts


def _heading_level(line: str, is_markdown: bool) -> int | None:
    """`line`: stripped."""
    if is_markdown:
        match = _MARKDOWN_HEADING.match(line)
        return len(match.group(1)) if match else None
    return 1 if _CAPS_HEADING.match(line) else None


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
