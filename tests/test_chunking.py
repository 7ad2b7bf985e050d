"""`structure` chunking: a Markdown document's headings start chunks, a configuration file's blocks
(comment + settings) stay whole when they fit, a PDF chunk never spans two pages, and every chunk is
the document's own text (a slice of it), so citations and page ranges stay exact."""

from __future__ import annotations

import re

import pytest

from configs.enums import ChunkingMode
from retrieval.chunker import PAGE_BREAK, Chunker


class Words:
    """One token per word or punctuation mark (blank lines count one), reversible."""

    def __init__(self) -> None:
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in re.findall(r"\w+|[^\w\s]|\n\s*\n", text):
            self.words.append(word)
            ids.append(len(self.words) - 1)
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def chunker(max_tokens: int, overlap: int = 0) -> Chunker:
    words = Words()
    return Chunker(words.encode, words.decode, max_tokens=max_tokens, num_overlap_tokens=overlap)


def _section(title: str, level: int, num_paragraphs: int) -> str:
    paragraphs = [f"The {title} part, paragraph {i}, says something about {title}." for i in range(num_paragraphs)]
    return "#" * level + f" {title}\n\n" + "\n\n".join(paragraphs)


MARKDOWN = "\n\n".join([
    "# Guide\n\nAn introduction of one paragraph, long enough to matter for the chunk it starts.",
    _section("Install", 2, 2),
    _section("Configure", 2, 2) + "\n\n" + _section("Files", 3, 1),
    "## Run\n\n```sh\n# not a heading: a comment in code\n\nragblend serve\n```\n\nThen ask a question.",
])


def test_markdown_headings_start_chunks():
    chunks = chunker(60).split(MARKDOWN, ChunkingMode.STRUCTURE, is_markdown=True)
    starts = [c.text.splitlines()[0] for c in chunks]
    assert starts == ["# Guide", "## Install", "## Configure", "### Files", "## Run"]
    assert "# not a heading" in chunks[4].text and chunks[4].text.endswith("Then ask a question.")  # code kept whole
    for chunk in chunks:
        assert chunk.text in MARKDOWN and chunk.page == 0  # the document's own text, exactly
        assert chunk.num_tokens <= 60 + 2


def test_a_heading_never_ends_a_chunk_and_a_long_section_is_cut_by_sentences():
    text = _section("Alpha", 2, 1) + "\n\n" + _section("Beta", 2, 12)  # Beta is longer than a chunk
    chunks = chunker(50).split(text, ChunkingMode.STRUCTURE, is_markdown=True)
    assert chunks[0].text.startswith("## Alpha") and "## Beta" not in chunks[0].text
    assert chunks[1].text.startswith("## Beta")  # the heading leads its first part
    assert len(chunks) > 3 and all(not c.text.rstrip().endswith("Beta") for c in chunks)
    assert all(c.num_tokens <= 50 + 2 for c in chunks)


CONFIG = """# /etc/example.conf: an example configuration.

# The login shell new users get.
DSHELL=/bin/bash

# Where home directories go.
# Each user gets one.
DHOME=/home

# The lowest and highest user ids
# handed out to normal users.
FIRST_UID=1000
LAST_UID=59999

# A setting with a long comment. It explains at length what the setting does and why it exists.
# It says when one should change it. It says what happens when it is changed. It names the other
# settings it interacts with. So it is longer than a whole chunk on its own, and must be cut.
LONG_SETTING=yes
"""


def test_a_configuration_files_blocks_stay_whole_when_they_fit():
    chunks = chunker(40).split(CONFIG, ChunkingMode.STRUCTURE)  # '#' lines are comments here, not headings
    blocks = [b for b in CONFIG.strip().split("\n\n")]
    for block in blocks[:-1]:  # every block that fits a chunk is inside one chunk, whole
        assert sum(block in c.text for c in chunks) == 1, block
    assert "FIRST_UID=1000\nLAST_UID=59999" in next(c.text for c in chunks if "FIRST_UID" in c.text)
    assert all(c.text in CONFIG for c in chunks)
    # the same file chunked by sentences cuts blocks apart
    by_tokens = chunker(40).split(CONFIG, ChunkingMode.TOKENS)
    assert any(sum(block in c.text for c in by_tokens) == 0 for block in blocks[:-1])


def test_a_pdf_chunk_never_spans_two_pages():
    pages = [" ".join(f"Page {p} sentence {i} is here." for i in range(n)) for p, n in ((1, 3), (2, 0), (3, 30), (4, 2))]
    text = ("\n" + PAGE_BREAK + "\n").join(pages)  # as app/extract/dispatch.py joins a PDF's pages
    chunks = chunker(60, overlap=8).split(text, ChunkingMode.STRUCTURE)
    assert {c.page for c in chunks} == {0, 2, 3}  # page 2 is empty: no chunk; numbering kept
    for chunk in chunks:
        assert PAGE_BREAK not in chunk.text
        assert all(f"Page {chunk.page + 1} " in sentence for sentence in re.findall(r"Page \d+ sentence", chunk.text))
    assert sum(c.page == 2 for c in chunks) > 1  # the long page is cut, within itself
    # the tokens chunking packs across the break (why `structure` is needed for exact page citations)
    assert any("Page 1 " in c.text and "Page 3 " in c.text for c in chunker(60).split(text, ChunkingMode.TOKENS))


def test_caps_section_lines_of_a_man_page_start_chunks():
    man = "NAME\n  tool - does things\n\nDESCRIPTION\n" + "  The tool does many things well. " * 4 + \
          "\n\nEXIT STATUS\n  0 on success, 2 on a warning.\n"
    chunks = chunker(50).split(man, ChunkingMode.STRUCTURE)
    assert chunks[-1].text.startswith("EXIT STATUS") and "2 on a warning" in chunks[-1].text
    assert chunks[0].text.startswith("NAME") and "DESCRIPTION" in chunks[0].text  # NAME is too small to stand alone


@pytest.mark.parametrize("mode", list(ChunkingMode))
def test_blank_text_gives_no_chunks(mode):
    assert chunker(10).split("  \n\f\n  ", mode) == []


def _holding_both(chunks, first: str, second: str) -> bool:
    return any(first in c.text and second in c.text for c in chunks)


def test_a_long_configuration_block_is_cut_between_entries_never_inside_one():
    """A configuration file's block longer than a chunk (comments and settings with no blank line between)
    is cut where a comment follows a setting: every setting keeps the comment that describes it."""
    entries = [f"#\n# Entry {i} sets how many seconds pass\n# before the lock number {i} ends.\n#\nNAME_{i}\t{i * 10}"
               for i in range(12)]
    text = "\n".join(entries)  # one block
    chunks = chunker(60).split(text, ChunkingMode.STRUCTURE)
    assert len(chunks) > 2
    for i in range(12):
        assert _holding_both(chunks, f"lock number {i} ends", f"NAME_{i}\t{i * 10}"), i
    assert all(c.text in text for c in chunks)


def test_a_manuals_options_stay_with_their_descriptions():
    """A manual's options: an option line ("-k --keep", "LineMax=") starts an entry that keeps its description
    when a block of many is cut (a PDF's extracted text has no indentation), and in a text manual an option's
    further paragraphs, indented deeper, go with it to the next chunk rather than being left at its start."""
    options = "OPTIONS\n" + "\n".join(
        f"-{chr(97 + i)} --option-{i}\nOption {i} changes a mode. It does thing number {i} quietly.\nIt is off by default."
        for i in range(10))
    chunks = chunker(50).split(options, ChunkingMode.STRUCTURE)
    for i in range(10):
        assert _holding_both(chunks, f"--option-{i}\n", f"thing number {i} quietly"), i
    manual = "\n\n".join(
        f"       Setting{i}=\n           Takes a number that says how wide line {i} may grow before it is cut.\n\n"
        f"           Defaults to {i * 100}." for i in range(6))
    chunks = chunker(70).split(manual, ChunkingMode.STRUCTURE)
    assert len(chunks) > 2
    for i in range(6):
        assert _holding_both(chunks, f"Setting{i}=", f"Defaults to {i * 100}."), i
    assert all(c.text in manual for c in chunks)
