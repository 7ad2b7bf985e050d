"""The pieces of decoding from a fused cache: repetition control, sampling, incremental detokenization,
stop strings (put together per request by blend_engine/sequence.py's TokenSampler)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from blend_engine.types import SamplingParams
from configs.enums import RepetitionScope


class RepetitionControl:
    """One sequence's repetition penalties and n-gram block, applied to its own logits row before it
    samples (greedy too: the argmax of the changed logits), so a sequence in a batch gets its own.

    In the order vLLM applies them: CTRL's repetition penalty (a seen token's positive logit divided by
    it, a negative one multiplied: Hugging Face's `RepetitionPenaltyLogitsProcessor`), over the answer's
    tokens or the prompt's too; OpenAI's frequency and presence penalties over the answer's tokens
    (logit - count * frequency - (count > 0) * presence); then every token that would complete an
    n-gram the answer already holds gets -inf (Hugging Face's `NoRepeatNGramLogitsProcessor`, over the
    answer only: blocking the prompt's n-grams would forbid quoting the documents). End-of-sequence
    tokens keep their logit: a penalty never stops an answer from ending.

    The state is kept as tokens come (the distinct tokens seen, their counts, the n-grams), not
    recomputed from the whole sequence at each step; the penalties read and write those tokens' logits
    only (a few hundred of a vocabulary of tens of thousands)."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), exempt_ids: Collection[int] = ()):
        self.params = params
        self.is_active = params.is_repetition_controlled
        self._exempt = frozenset(exempt_ids)
        is_prompt_covered = params.repetition_scope is RepetitionScope.PROMPT_AND_ANSWER and params.repetition_penalty != 1.0
        # the distinct tokens the repetition penalty covers, in the order first seen
        self._covered: dict[int, None] = dict.fromkeys(t for t in prompt_ids if t not in self._exempt) \
            if is_prompt_covered else {}
        self._counts: dict[int, int] = {}  # generated token -> times generated (exempt ones left out)
        self._generated: list[int] = []
        self._ngrams: dict[tuple[int, ...], set[int]] = {}  # an n-gram's first n-1 tokens -> its last tokens
        self._covered_ids: torch.Tensor | None = None  # [C] long: `_covered` on the logits' device, made anew
        self._generated_ids: torch.Tensor | None = None  # [G] long: `_counts`' keys, likewise
        self._is_stale = True  # a token joined since the tensors were made

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> the penalized logits [vocab] (a new tensor; `logits` itself when inactive)."""
        if not self.is_active:
            return logits
        params, out, vocab = self.params, logits, logits.shape[-1]
        if self._is_stale:
            self._covered_ids = _ids([t for t in self._covered if t < vocab], logits.device)
            self._generated_ids = _ids([t for t in self._counts if t < vocab], logits.device)
            self._is_stale = False
        if params.repetition_penalty != 1.0 and self._covered_ids.numel():
            seen = out.index_select(0, self._covered_ids)  # [C]
            seen = torch.where(seen > 0, seen / params.repetition_penalty, seen * params.repetition_penalty)
            out = out.index_copy(0, self._covered_ids, seen)
        if (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0) and self._generated_ids.numel():
            counts = torch.tensor([self._counts[t] for t in self._counts if t < vocab], dtype=out.dtype)  # [G]
            penalty = counts.to(out.device) * params.frequency_penalty + params.presence_penalty
            out = out.index_add(0, self._generated_ids, penalty, alpha=-1)
        blocked = [t for t in self._blocked() if t < vocab and t not in self._exempt]
        if blocked:
            out = out.index_fill(0, _ids(blocked, out.device), float("-inf"))
        return out

    def observe(self, token: int) -> None:
        """The token just sampled: counted, covered, and the n-gram it ends recorded."""
        if not self.is_active:
            return
        if token not in self._exempt:
            self._is_stale |= token not in self._counts or (
                self.params.repetition_penalty != 1.0 and token not in self._covered)
            self._counts[token] = self._counts.get(token, 0) + 1
            if self.params.repetition_penalty != 1.0:
                self._covered.setdefault(token, None)
        self._generated.append(token)
        n = self.params.no_repeat_ngram_size
        if n and len(self._generated) >= n:
            self._ngrams.setdefault(tuple(self._generated[len(self._generated) - n : -1]), set()).add(token)

    def _blocked(self) -> set[int]:
        """The tokens that would complete an n-gram generated before."""
        n = self.params.no_repeat_ngram_size
        if not n or len(self._generated) < n - 1:
            return set()
        return self._ngrams.get(tuple(self._generated[len(self._generated) - (n - 1) :]), set())


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long, device=device)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Next token from logits [vocab]: greedy at temperature 0, else temperature + top-p."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        is_outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[is_outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


class IncrementalDetokenizer:
    """Turns a growing token list into text pieces without splitting a multi-byte character."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this are final and emitted
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""


class StopStringFilter:
    """Holds back text that may be the start of a stop string; reports when one is complete."""

    def __init__(self, stop: tuple[str, ...]):
        self._stop = tuple(s for s in stop if s)
        self._pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, is_stopped)."""
        self._pending += text
        for s in self._stop:
            idx = self._pending.find(s)
            if idx >= 0:
                out, self._pending = self._pending[:idx], ""
                return out, True
        hold = max((_overlap(self._pending, s) for s in self._stop), default=0)
        out, self._pending = self._pending[: len(self._pending) - hold], self._pending[len(self._pending) - hold :]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
