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

from blend_engine.active import RopeTable
from blend_engine.attention import AttentionLayout, AttentionMeta, attend, attend_int8_heads, fold_int8_queries
from blend_engine.decode import Decoder, capture_graph
from blend_engine.decode_cache import Int8KVCache, write_rows
from blend_engine.kv import KVCache
from blend_engine.runner import ModelRunner, apply_rope


@torch.inference_mode()
def batch_step(runner: ModelRunner, decoders: Sequence[Decoder], token_ids: Sequence[int]) -> torch.Tensor:
    """Feed token_ids[b] after decoders[b]'s cache end, for every b at once; next-token logits [B, vocab]
    (float32). At B = 1 it computes what `Decoder`'s eager step computes, bit for bit (over other caches
    than int8 by the same ops, in the same order)."""
    positions = [decoder.reserve() for decoder in decoders]  # each sequence's own next slot
    hidden = runner.embed(torch.tensor(list(token_ids), device=runner.device))  # [B, hidden]
    if all(isinstance(decoder.cache, Int8KVCache) for decoder in decoders):
        return _int8(runner, decoders, positions, hidden)
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


def _int8(runner: ModelRunner, decoders: Sequence[Decoder], positions: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """`batch_step` over int8 decode caches (at any B): each sequence's K/V write and attention are
    `Int8Slots.write`'s and `attend_last_int8`'s, bit for bit, but what is done per row there runs once
    per layer for the batch (quantizing and writing the new K/V, scaling q), and each cache's views
    once per step (`Int8KVCache.step`). The per-sequence path made ~50 small torch calls per sequence
    and layer besides its 6 kernel calls (at B = 8, ~40% of a step); this one 3 (4 with a column bias)."""
    num_tokens, num_kv_heads = len(decoders), runner.num_kv_heads
    steps = [decoder.cache.step(pos, runner.num_heads // num_kv_heads) for decoder, pos in zip(decoders, positions)]
    biases = [[decoder.cache.bias_at(layer, pos + 1) for layer in range(runner.num_layers)]  # [N] or None
              for decoder, pos in zip(decoders, positions)]
    rows = [decoder.rope_rows(pos) for decoder, pos in zip(decoders, positions)]
    rope = torch.cat([cos for cos, _ in rows]), torch.cat([sin for _, sin in rows])  # [B, D] each
    for layer in range(runner.num_layers):
        calls = runner.calls[layer]
        q, k, v = calls.qkv(hidden, rope)  # [H, B, D], [H_kv, B, D] x2; row b rotated at positions[b]
        write_rows(steps, layer, k, v)
        heads = fold_int8_queries(q, runner.scaling, num_kv_heads).unbind(0)  # [G, D]: token b's at b * H_kv ..
        out = []
        for b, step in enumerate(steps):
            own = heads[b * num_kv_heads : (b + 1) * num_kv_heads]
            out += attend_int8_heads(own, step.heads[layer], biases[b][layer])
        hidden = calls.finish(hidden, torch.stack(out).view(num_tokens, -1).to(q.dtype))  # out: [B * H_kv, G, D]
    return runner.logits(hidden)  # [B, vocab]


class StaticBatch:
    """The batched step with every shape static, as a CUDA graph needs it (nano-vllm's per-batch-size
    buckets): `num_rows` rows whose tokens and positions are read from device buffers, each bound
    sequence's row attending over its cache's whole capacity with a mask made on the device from its
    position (as `Decoder.static_step` does for one), rows past the bound sequences over a scratch
    cache of their own. Caches in the prefill's format (`KVCache`) only: the graphed decode's.

    A graph captures the caches' storage: it is valid while the same caches (at the same capacities)
    are bound, so a change of the batch's members, or a cache growing, needs a new capture. On CPU
    the same `static_step` runs eagerly (the tests), which checks the function a graph would replay.
    """

    def __init__(self, runner: ModelRunner, num_rows: int):
        self.runner, self.num_rows = runner, num_rows
        device = runner.device
        self._tokens = torch.zeros(num_rows, dtype=torch.long, device=device)  # [R] fed this step
        self._pos = torch.zeros(num_rows, dtype=torch.long, device=device)  # [R] their positions
        self._zero = torch.zeros((), dtype=runner.dtype, device=device)
        self._minus_inf = torch.full((), float("-inf"), dtype=runner.dtype, device=device)
        # padding rows write and read slot 0 of this cache only: it must hold finite values
        self._scratch = KVCache(runner.num_layers, runner.num_kv_heads, runner.head_dim, 16, device, runner.dtype)
        with torch.inference_mode():
            self._scratch.keys.zero_(), self._scratch.values.zero_()
        self._caches: list[KVCache] = []
        self._binding: tuple[tuple[int, int], ...] = ()  # (storage, capacity) of each bound cache
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the graph's output buffer [R, vocab]

    def bind(self, caches: Sequence[KVCache]) -> bool:
        """Bind these caches to the first rows (every slot each is to write already reserved by
        `extend`); True where they differ from the bound ones (a captured graph is then stale)."""
        if not 0 < len(caches) <= self.num_rows:
            raise ValueError(f"a bucket of {self.num_rows} rows takes 1 to {self.num_rows} sequences, "
                             f"not {len(caches)}")
        if not all(isinstance(c, KVCache) for c in caches):
            raise ValueError("the static batched step runs over the prefill's own caches (decode_cache model)")
        binding = tuple((c.keys.data_ptr(), c.capacity) for c in caches)
        if binding == self._binding:
            return False
        self._caches, self._binding, self._graph = list(caches), binding, None
        with torch.inference_mode():  # unwritten slots must be finite (NaN times a zero weight is NaN)
            for cache in caches:
                cache.keys[:, :, cache.length :].zero_()
                cache.values[:, :, cache.length :].zero_()
        capacity = max(c.capacity for c in caches)
        cos, sin = self.runner.rope(torch.arange(capacity, device=self.runner.device))  # [capacity, D] each
        self._rope = RopeTable(cos, sin)
        self._slots = {c.capacity: torch.arange(c.capacity, device=self.runner.device)  # [capacity] slot numbers
                       for c in [*caches, self._scratch]}
        return True

    def load(self, token_ids: Sequence[int], positions: Sequence[int]) -> None:
        """The bound rows' tokens and positions (the padding rows: token 0 at slot 0 of the scratch)."""
        num = len(token_ids)
        self._tokens.zero_(), self._pos.zero_()
        self._tokens[:num] = torch.tensor(list(token_ids), dtype=torch.long)
        self._pos[:num] = torch.tensor(list(positions), dtype=torch.long)

    def static_step(self) -> torch.Tensor:
        """One step over the buffers: logits [R, vocab] (the padding rows' are meaningless)."""
        runner = self.runner
        caches = self._caches + [self._scratch] * (self.num_rows - len(self._caches))
        hidden = runner.embed(self._tokens)  # [R, hidden]
        cos, sin = self._rope.cos.index_select(0, self._pos), self._rope.sin.index_select(0, self._pos)  # [R, D]
        metas, biased = [], []
        for row, cache in enumerate(caches):
            pos = self._pos[row : row + 1]  # [1]
            slots = self._slots[cache.capacity]
            mask = torch.where(slots[None, :] <= pos[:, None], self._zero, self._minus_inf)  # [1, capacity]
            metas.append(AttentionMeta(AttentionLayout.SUBSET, cache.capacity, mask=mask))
            biased.append(metas[-1] if cache.column_bias is None else
                          AttentionMeta(AttentionLayout.SUBSET, cache.capacity, mask=mask + cache.column_bias.values))
        for layer in range(runner.num_layers):
            q, k, v = runner.qkv(layer, hidden)  # [H, R, D], [H_kv, R, D] x2
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            outs = []
            for row, cache in enumerate(caches):
                pos = self._pos[row : row + 1]
                cache.keys[layer].index_copy_(1, pos, k[:, row : row + 1])
                cache.values[layer].index_copy_(1, pos, v[:, row : row + 1])
                meta = biased[row] if cache.is_biased_at(layer) else metas[row]
                outs.append(attend(q[:, row : row + 1], cache.keys[layer], cache.values[layer], meta, runner.scaling))
            hidden = runner.finish(layer, hidden, torch.cat(outs))  # outs: [1, H*D] per row
        return runner.logits(hidden)  # [R, vocab]

    @torch.inference_mode()
    def step(self, caches: Sequence[KVCache], token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [B, vocab] of the B bound sequences: on CUDA the bucket's graph replayed (captured
        again where the caches changed), elsewhere `static_step` run eagerly."""
        self.bind(caches)
        self.load(token_ids, positions)
        if self.runner.device.type != "cuda":
            return self.static_step()[: len(caches)]
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._logits[: len(caches)].clone()  # the buffer is overwritten by the next replay

    def _capture(self) -> None:
        """As `Decoder._capture`: warm-up runs on a side stream, then the capture. The warm-up writes
        K/V at the loaded positions only, which the replay then overwrites with the same values."""
        self._graph, self._logits = capture_graph(self.runner.device, self.static_step)
