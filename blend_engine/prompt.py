"""Chat-template-aware RAG prompts, as segments: [prefix, chunk_1, sep, chunk_2, ..., suffix].

The template is rendered once around a placeholder user message and split there, so any model's
chat template works and the chunks' token ids are exactly their stored ones.
"""

from __future__ import annotations

from typing import Sequence

from blend_engine.types import Segment

_PLACEHOLDER = "\x00RAGBLEND_CONTENT\x00"
DOCUMENTS_INTRO = "Documents:\n\n"
CHUNK_SEPARATOR = "\n\n"
QUESTION_INTRO = "\n\nQuestion: "
ANSWER_HINT = "\nAnswer briefly."


class PromptBuilder:
    def __init__(self, tokenizer, system_prompt: str):
        if tokenizer is None:
            raise ValueError("building prompts needs a tokenizer")
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def _template_halves(self, history: Sequence[dict]) -> tuple[str, str]:
        messages = []
        if self.system_prompt and not (history and history[0].get("role") == "system"):
            messages.append({"role": "system", "content": self.system_prompt})
        messages += [dict(m) for m in history]
        messages.append({"role": "user", "content": _PLACEHOLDER})
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # a tokenizer with no template: plain role-prefixed lines
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        before, _, after = text.partition(_PLACEHOLDER)
        return before, after

    def prefix_ids(self, history: Sequence[dict] = ()) -> tuple[int, ...]:
        """The tokens before the first chunk (chat header, system prompt, history, documents intro)."""
        before, _ = self._template_halves(history)
        return self.encode(before + DOCUMENTS_INTRO)

    def segments(self, question: str, chunks: Sequence[Segment], history: Sequence[dict] = ()) -> list[Segment]:
        """Prompt segments; the chunks keep their token ids and caches, separators and the rest are fresh."""
        _, after = self._template_halves(history)
        separator = self.encode(CHUNK_SEPARATOR)
        out = [Segment(self.prefix_ids(history))]
        for i, chunk in enumerate(chunks):
            if i:
                out.append(Segment(separator))
            out.append(chunk)
        out.append(Segment(self.encode(QUESTION_INTRO + question + ANSWER_HINT + after)))
        return out

    def chat_ids(self, messages: Sequence[dict]) -> tuple[int, ...]:
        """A plain chat prompt (no documents), with the generation prompt appended."""
        text = self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
        return self.encode(text)
