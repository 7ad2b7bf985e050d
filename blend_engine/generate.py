"""The pieces of decoding from a fused cache: sampling, incremental detokenization, stop strings
(put together per request by blend_engine/sequence.py's TokenSampler)."""

from __future__ import annotations

import torch

from blend_engine.types import SamplingParams


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
