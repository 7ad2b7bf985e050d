"""One decode step for many sequences at once: the embedding, q/k/v, o_proj, MLP and lm_head run on
all B rows together ([B, hidden]: the weights are read once per step, not once per sequence, which is
the whole gain on a memory-bound CPU or GPU), each row rotated at its own position; attention runs per
sequence over its own cache (its format, its length, its column bias), which is where sequences differ.

Per-sequence attention rather than one call over a padded batch: the caches differ in length, format
and bias, one padded call would copy every cache into a [B, H_kv, max_len, D] block per layer (the
copy costs what the attention reads), and a ragged kernel over separate caches is not in torch's CPU
ops. What each sequence computes is then its own B = 1 attention, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from blend_engine.decode import Decoder
from blend_engine.runner import ModelRunner


@torch.inference_mode()
def batch_step(runner: ModelRunner, decoders: Sequence[Decoder], token_ids: Sequence[int]) -> torch.Tensor:
    """Feed token_ids[b] after decoders[b]'s cache end, for every b at once; next-token logits [B, vocab]
    (float32). At B = 1 it runs the ops `Decoder`'s eager step runs, in the same order."""
    positions = [decoder.reserve() for decoder in decoders]  # each sequence's own next slot
    hidden = runner.embed(torch.tensor(list(token_ids), device=runner.device))  # [B, hidden]
    if len(decoders) == 1:
        return _single(runner, decoders[0], positions[0], hidden)
    rows = [decoder.rope_rows(pos) for decoder, pos in zip(decoders, positions)]
    rope = torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])  # [B, D] each
    for layer in range(runner.num_layers):
        calls = runner.calls[layer]
        q, k, v = calls.qkv(hidden, rope)  # [H, B, D], [H_kv, B, D] x2; row b rotated at positions[b]
        out = torch.cat([
            decoder.attend_layer(layer, q[:, b : b + 1], k[:, b : b + 1], v[:, b : b + 1], pos)
            for b, (decoder, pos) in enumerate(zip(decoders, positions))
        ])  # [B, H*D]
        hidden = calls.finish(hidden, out)
    return runner.logits(hidden)  # [B, vocab]


def _single(runner: ModelRunner, decoder: Decoder, pos: int, hidden: torch.Tensor) -> torch.Tensor:
    """B = 1 without the slicing and concatenation (a few µs per layer the step would pay for nothing)."""
    rope = decoder.rope_rows(pos)  # [1, D] each
    for layer in range(runner.num_layers):
        calls = runner.calls[layer]
        q, k, v = calls.qkv(hidden, rope)  # [H, 1, D], [H_kv, 1, D] x2
        hidden = calls.finish(hidden, decoder.attend_layer(layer, q, k, v, pos))
    return runner.logits(hidden)  # [1, vocab]
