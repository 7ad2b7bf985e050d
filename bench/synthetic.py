"""Prompts of random token ids shaped like the dataset's, for models without a tokenizer (a
random-weight shape on a bare GPU host, where the embedded tokenizer's package is not installed).

Lengths follow the text: the dataset's passages average 3.96 characters per SmolLM2 token and its
questions 4.47 (measured on ../shared/data/musique_dev.json), so 5 passages give about the same
~3k-token prompt as with the real tokenizer. The layout mirrors PromptBuilder's: a 30-token prefix
(the chat header and system prompt), chunks with 2-token separators, then the question's suffix.
"""

from __future__ import annotations

import torch

from bench.musique import Question
from blend_engine.engine import BlendEngine
from blend_engine.types import Segment
from configs.enums import SinkMode

CHARS_PER_PASSAGE_TOKEN = 3.96
CHARS_PER_QUESTION_TOKEN = 4.47
NUM_PREFIX_TOKENS = 30
NUM_SEPARATOR_TOKENS = 2
NUM_SUFFIX_TOKENS = 15  # "Answer briefly." and the assistant header around the question


def synthetic_prompt(engine: BlendEngine, question: Question, sink: SinkMode, seed: int) -> list[Segment]:
    """[prefix (with its exact KV), chunk, sep, chunk, ..., question]: chunks precomputed behind `sink`."""
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(3, vocab, (max(1, n),), generator=g).tolist())

    prefix = ids(NUM_PREFIX_TOKENS)
    context = {SinkMode.NONE: (), SinkMode.BOS: (1,), SinkMode.PREFIX: prefix}[sink]
    segments = [Segment(prefix, engine.precompute(prefix))]
    for i, text in enumerate(question.passages):
        if i:
            segments.append(Segment(ids(NUM_SEPARATOR_TOKENS)))
        chunk = ids(round(len(text) / CHARS_PER_PASSAGE_TOKEN))
        segments.append(Segment(chunk, engine.precompute(chunk, context)))
    segments.append(Segment(ids(round(len(question.question) / CHARS_PER_QUESTION_TOKEN) + NUM_SUFFIX_TOKENS)))
    return segments
