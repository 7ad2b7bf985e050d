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

    The state is kept as tokens come (counts over the vocabulary, the n-grams seen), not recomputed from
    the whole sequence at each step."""

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int] = (), exempt_ids: Collection[int] = ()):
        self.params = params
        self.is_active = params.is_repetition_controlled
        is_prompt_covered = params.repetition_scope is RepetitionScope.PROMPT_AND_ANSWER and params.repetition_penalty != 1.0
        self._prompt_ids = tuple(prompt_ids) if is_prompt_covered else ()
        self._exempt_ids = tuple(sorted(exempt_ids))
        self._counts: torch.Tensor | None = None  # [vocab] float32: times each token was generated
        self._is_seen: torch.Tensor | None = None  # [vocab] bool: the tokens the repetition penalty covers
        self._exempt: torch.Tensor | None = None  # [E] long: end-of-sequence ids inside the vocabulary
        self._generated: list[int] = []
        self._ngrams: dict[tuple[int, ...], set[int]] = {}  # an n-gram's first n-1 tokens -> its last tokens

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> the penalized logits [vocab] (a new tensor; `logits` itself when inactive)."""
        if not self.is_active:
            return logits
        if self._counts is None:
            self._start(logits)
        params, out = self.params, logits
        if params.repetition_penalty != 1.0:
            penalized = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(self._is_seen, penalized, out)
        if params.frequency_penalty != 0.0:
            out = out - self._counts * params.frequency_penalty
        if params.presence_penalty != 0.0:
            out = out - (self._counts > 0).to(out.dtype) * params.presence_penalty
        blocked = self._blocked()
        if blocked:
            if out is logits:
                out = logits.clone()
            out.index_fill_(0, torch.tensor(sorted(blocked), device=out.device), float("-inf"))
        if out is not logits and self._exempt.numel():
            out.index_copy_(0, self._exempt, logits.index_select(0, self._exempt))
        return out

    def observe(self, token: int) -> None:
        """The token just sampled: counted, seen, and the n-gram it ends recorded."""
        if not self.is_active:
            return
        self._counts[token] += 1
        self._is_seen[token] = True
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

    def _start(self, logits: torch.Tensor) -> None:
        vocab, device = logits.shape[-1], logits.device
        self._counts = torch.zeros(vocab, dtype=logits.dtype, device=device)
        self._is_seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        prompt = [t for t in self._prompt_ids if 0 <= t < vocab]
        if prompt:
            self._is_seen[torch.tensor(prompt, device=device)] = True
        self._exempt = torch.tensor([t for t in self._exempt_ids if 0 <= t < vocab], dtype=torch.long, device=device)


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
