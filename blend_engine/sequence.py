"""One request's decode state, as a step scheduler drives it: `TokenSampler` (what was `decode_loop`'s
per-request state: sampling, detokenizing, stop strings, limits) and `DecodeSequence` (its sampler,
its decoder over its own cache, the token to feed next). `BlendEngine.decode_step` feeds the pending
tokens of many sequences in one forward (blend_engine/batch_decode.py); each sequence then samples
from its own row of logits, so what it generates never depends on what else is in the batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from blend_engine.decode import Decoder
from blend_engine.generate import IncrementalDetokenizer, RepetitionControl, StopStringFilter, sample
from blend_engine.types import Delta, FinishReason, PrefillResult, SamplingParams


class TokenSampler:
    """Repetition control, sampling (greedy, or temperature + top-p from the request's own seeded
    generator), incremental detokenizing, stop strings, max_tokens and the context's room, one token at
    a time."""

    def __init__(self, tokenizer, eos_ids: frozenset[int], params: SamplingParams, max_steps: int,
                 device: torch.device, prompt_ids: Sequence[int] = ()):
        """`max_steps`: the tokens the context has room for (the limit is the smaller of it and
        max_tokens); `tokenizer` None: token ids only, every Delta's text empty (tests' tiny models);
        `prompt_ids`: the prompt (a repetition penalty over the prompt covers its tokens)."""
        self.params = params
        self.repetition = RepetitionControl(params, prompt_ids, eos_ids)
        self.eos_ids = eos_ids
        self.max_tokens = min(params.max_tokens, max_steps)
        # a seeded request draws from its own generator: the same tokens whatever runs beside it
        self.generator = None if params.seed is None else torch.Generator(device=device).manual_seed(params.seed)
        self.detokenizer = None if tokenizer is None else IncrementalDetokenizer(tokenizer)
        self.stops = StopStringFilter(params.stop)
        self.token_ids: list[int] = []  # every token sampled, the last one (EOS) included
        self.is_finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def push(self, logits: torch.Tensor) -> tuple[Delta, int | None]:
        """Sample from logits [vocab]: the Delta for the new token (its text may be "") and the token to
        feed next, or None once finished (the Delta's finish_reason is then set)."""
        if self.is_finished:
            raise ValueError("this sequence has finished: it samples no more tokens")
        token = sample(self.repetition.apply(logits), self.params, self.generator)
        self.repetition.observe(token)
        self.token_ids.append(token)
        num_tokens = len(self.token_ids)
        if token in self.eos_ids and not self.params.is_eos_ignored:
            return self._finish(Delta(self.stops.flush(), num_tokens, FinishReason.STOP))
        piece = "" if self.detokenizer is None else self.detokenizer.push(token)
        text, is_stopped = self.stops.push(piece)
        if is_stopped:
            return self._finish(Delta(text, num_tokens, FinishReason.STOP))
        if num_tokens >= self.max_tokens:
            return self._finish(Delta(text + self.stops.flush(), num_tokens, FinishReason.LENGTH))
        return Delta(text, num_tokens), token

    def _finish(self, delta: Delta) -> tuple[Delta, None]:
        self.is_finished = True
        return delta, None


class DecodeSequence:
    """One request between steps: its sampler, the token to feed next, and its decoder (its own decode
    cache in the engine's format, a copy as `BlendEngine.decoder` makes it, and its RoPE tables).

    The decoder is made by `prepare`, which the first `decode_step` over the sequence calls unless the
    caller did before: the cache copy is then not in the request's time to first token."""

    def __init__(self, result: PrefillResult, sampler: TokenSampler, next_token: int | None,
                 make_decoder: Callable[[PrefillResult], Decoder]):
        self.sampler = sampler
        self.next_token = next_token  # None once finished
        self._result: PrefillResult | None = None if next_token is None else result  # until prepared
        self._make_decoder = make_decoder
        self.decoder: Decoder | None = None

    @property
    def is_finished(self) -> bool:
        return self.next_token is None

    @property
    def num_tokens(self) -> int:
        """Completion tokens so far (the finishing EOS included, as Delta.num_tokens counts it)."""
        return self.sampler.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The completion's token ids so far."""
        return self.sampler.token_ids

    @property
    def nbytes(self) -> int:
        """Bytes of the KV cache this sequence holds: its decode cache once prepared, the prefill's
        before; 0 once finished (it lets go of both)."""
        if self.decoder is not None:
            return self.decoder.cache.nbytes
        return 0 if self._result is None else self._result.cache.nbytes

    def prepare(self) -> Decoder:
        """The sequence's decoder, made on the first call (the decode cache copy: see the class)."""
        if self.is_finished:
            raise ValueError("this sequence has finished: it decodes no more tokens")
        if self.decoder is None:
            self.decoder, self._result = self._make_decoder(self._result), None
        return self.decoder

    def accept(self, logits: torch.Tensor) -> Delta:
        """Sample the next token from this sequence's logits [vocab]; the Delta for it. A finished
        sequence lets go of its cache."""
        delta, self.next_token = self.sampler.push(logits)
        if self.next_token is None:
            self.decoder = None
        return delta
