"""Chat-template-aware RAG prompts, as segments: [prefix, label, chunk, label, chunk, ..., suffix].

The template is rendered once around a placeholder and split there, so any model's chat template
works and the chunks' token ids are exactly their stored ones. Each chunk is numbered by a label segment
of its own before it ("[3] ", then "\n\n[2] ", ...: fresh tokens, never inside the chunk's stored tokens,
and after the prefix the chunks' KV was computed behind), so the answer can cite the chunk it used as [n]
(app/rag/citations.py maps each [n] back to its source). Chunk n is the n-th of the caller's chunks (the
best ranked first, as the sources list them); the prompt holds them in `chunk_order`: by default the best
ranked nearest the question (docs/decisions/0021).

Layout: the documents open the conversation's first user message (its question after them), the
earlier turns follow, then the new question. Every user message reads `Question: ...` plus the
answer instruction, as it did when it was the question. So a follow-up turn over the same documents begins
with the whole prompt of the turn before it (the earlier answer and the new question come after):
a prefix cache serves everything up to them (runtime/executor.py). A single question's prompt is
[system, user: documents, question]; the chunks sit behind the same tokens with or without history
(the `prefix` sink they are precomputed behind, when the history begins with the user).

Control tokens never come from text: every message's content is replaced by a slot before the
template is rendered, so only the template's own structure is encoded with special-token parsing on;
contents (documents, the question, history, the system prompt) are encoded as plain text, where
`<|im_end|>` becomes ordinary tokens.
"""

from __future__ import annotations

import re
from typing import Sequence

from blend_engine.config import ModelConfig
from blend_engine.types import Segment
from configs.enums import ChunkOrder

_PLACEHOLDER = "\x00RAGBLEND_CONTENT\x00"
_SLOT = "\x00RAGBLEND_SLOT_{}\x00"
_SLOT_PATTERN = re.compile("\x00RAGBLEND_SLOT_([0-9]+)\x00")
DOCUMENTS_INTRO = "Documents:\n\n"
CHUNK_SEPARATOR = "\n\n"
QUESTION_INTRO = "\n\nQuestion: "
QUESTION_LABEL = "Question: "  # a user message after the first (no documents before it)
CHUNK_LABEL = "[{number}] "  # chunk n's number, as the answer is asked to cite it


def encode_text(tokenizer, text: str) -> tuple[int, ...]:
    """Untrusted text -> token ids, special-token parsing off: `<|im_end|>` in text is plain text."""
    return tuple(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))


class PromptBuilder:
    def __init__(self, tokenizer, system_prompt: str, answer_instruction: str = ModelConfig.answer_instruction,
                 chunk_order: ChunkOrder = ModelConfig.chunk_order):
        """`answer_instruction`: the line after each question (none when empty)."""
        if tokenizer is None:
            raise ValueError("building prompts needs a tokenizer")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.answer_instruction = answer_instruction
        self.chunk_order = chunk_order

    @property
    def _instruction(self) -> str:
        return "\n" + self.answer_instruction if self.answer_instruction else ""

    def encode(self, text: str) -> tuple[int, ...]:
        """Text (a document, a question): never yields a special token."""
        return encode_text(self.tokenizer, text)

    def _encode_structure(self, text: str, contents: Sequence[str]) -> tuple[int, ...]:
        """A rendered template: its own markup with special tokens parsed, its content slots as text."""
        ids: list[int] = []
        start = 0
        for match in _SLOT_PATTERN.finditer(text):
            ids += self.tokenizer.encode(text[start : match.start()], add_special_tokens=False)
            ids += self.encode(contents[int(match.group(1))])
            start = match.end()
        ids += self.tokenizer.encode(text[start:], add_special_tokens=False)
        return tuple(ids)

    def _render(self, messages: Sequence[dict], is_generation_prompt: bool = True) -> tuple[str, list[str]]:
        """The template rendered with each content replaced by a slot (the placeholder is kept)."""
        contents: list[str] = []
        slotted = []
        for message in messages:
            content = message["content"]
            if content != _PLACEHOLDER:
                contents.append(content)
                content = _SLOT.format(len(contents) - 1)
            slotted.append({**message, "content": content})
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(slotted, tokenize=False,
                                                      add_generation_prompt=is_generation_prompt)
        else:  # a tokenizer with no template: plain role-prefixed lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in slotted) + "assistant: "
        return text, contents

    def _template_halves(self, question: str, history: Sequence[dict]) -> tuple[str, str, list[str], str]:
        """The template split at the documents: the text before and after them, the contents of the
        slots, and the question that follows the documents in the first user message."""
        messages = []
        if self.system_prompt and not (history and history[0].get("role") == "system"):
            messages.append({"role": "system", "content": self.system_prompt})
        messages += [dict(m) for m in history]
        messages.append({"role": "user", "content": question})
        first = next(i for i, m in enumerate(messages) if m.get("role") == "user")
        first_question = messages[first]["content"]
        for i in range(first + 1, len(messages)):  # every later user message as its question was asked
            if messages[i].get("role") == "user":
                messages[i] = {**messages[i], "content": QUESTION_LABEL + messages[i]["content"] + self._instruction}
        messages[first] = {**messages[first], "content": _PLACEHOLDER}
        text, contents = self._render(messages)
        before, _, after = text.partition(_PLACEHOLDER)
        return before, after, contents, first_question

    def prefix_ids(self, history: Sequence[dict] = ()) -> tuple[int, ...]:
        """The tokens before the first chunk (chat header, system prompt, any turn before the first user
        message, documents intro): the same with or without history when it begins with the user."""
        before, _, contents, _ = self._template_halves("", history)
        return self._encode_structure(before, contents) + self.encode(DOCUMENTS_INTRO)

    def chunk_label(self, number: int, is_first: bool) -> tuple[int, ...]:
        """The label before chunk `number` (from 1): its number, after a separator unless it comes first."""
        return self.encode(("" if is_first else CHUNK_SEPARATOR) + CHUNK_LABEL.format(number=number))

    def segments(self, question: str, chunks: Sequence[Segment], history: Sequence[dict] = ()) -> list[Segment]:
        """Prompt segments for `chunks` ranked best first; the chunks keep their token ids and caches, their
        labels and the rest are fresh."""
        before, after, contents, first_question = self._template_halves(question, history)
        out = [Segment(self._encode_structure(before, contents) + self.encode(DOCUMENTS_INTRO))]
        numbered = list(enumerate(chunks, 1))
        if self.chunk_order is ChunkOrder.BEST_LAST:
            numbered.reverse()
        for position, (number, chunk) in enumerate(numbered):
            label = self.chunk_label(number, is_first=position == 0)
            out += [Segment(label), chunk] if label else [chunk]
        suffix = (self.encode(QUESTION_INTRO + first_question + self._instruction)
                  + self._encode_structure(after, contents))
        out.append(Segment(suffix))
        return out

    def chat_ids(self, messages: Sequence[dict]) -> tuple[int, ...]:
        """A plain chat prompt (no documents), with the generation prompt appended."""
        text, contents = self._render(list(messages))
        return self._encode_structure(text, contents)
