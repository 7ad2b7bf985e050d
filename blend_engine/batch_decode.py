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
import torch.nn.functional as F

from blend_engine.active import RopeTable
from blend_engine.attention import attend_int8, fold_int8_queries
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
        folded = fold_int8_queries(q, runner.scaling, num_kv_heads)  # [B * H_kv, G, D]: token b's at b * H_kv ..
        out = [attend_int8(folded[b * num_kv_heads : (b + 1) * num_kv_heads], step.layers[layer], biases[b][layer],
                           step.heads[layer] if step.heads else None) for b, step in enumerate(steps)]  # [H_kv, G, D]
        hidden = calls.finish(hidden, torch.cat(out).view(num_tokens, -1).to(q.dtype))
    return runner.logits(hidden)  # [B, vocab]


class StaticBatch:
    """The batched step with every shape static, as a CUDA graph needs it (nano-vllm's per-batch-size
    buckets): `num_rows` rows whose tokens and positions are read from device buffers, over a KV pool
    of the bucket's own ([L, R, H_kv, C, D]: row r holds the cache of the sequence bound to it), so
    each layer's attention is one call for every row (a [R, 1, 1, C] mask from each row's position,
    plus its column bias) and each layer's new K/V one write. Rows past the bound sequences are
    padding (token 0 at slot 0 of their row: finite, never read back). Caches in the prefill's format
    (`KVCache`) only: the graphed decode's.

    Why a pool: a graph captures storage, and the sequences' own caches change with the batch's
    members; the pool does not, so a bucket's graph is captured once and stays valid while members
    come and go (each joining cache is copied into a free row; measured on an H100 at Llama-2-7B
    shape: one attention call over 16 rows 2.96 ms for 32 layers at C = 1024 against 6.70 ms as 16
    calls, docs/benchmarks/gpu.md). The pool is made anew only when a cache outgrows it.

    While bound, a sequence's new K/V live in the pool only: `release` (or a later `bind` without
    it) copies them back into its cache, so the cache is whole again before anything else reads it.
    On CPU the same `static_step` runs eagerly (the tests), which checks the function a graph replays.
    """

    CAPACITY_ROUNDING = 128  # pool slots: a multiple of this (and of 16, the masked kernel's alignment)

    def __init__(self, runner: ModelRunner, num_rows: int):
        self.runner, self.num_rows = runner, num_rows
        device = runner.device
        self._tokens = torch.zeros(num_rows, dtype=torch.long, device=device)  # [R] fed this step
        self._pos = torch.zeros(num_rows, dtype=torch.long, device=device)  # [R] their positions
        self._row_ids = torch.arange(num_rows, device=device)  # [R]
        self._zero = torch.zeros((), dtype=runner.dtype, device=device)
        self._minus_inf = torch.full((), float("-inf"), dtype=runner.dtype, device=device)
        self._members: list[KVCache | None] = [None] * num_rows  # the cache bound to each row
        # slots [start, end) of each member's cache live in the pool only (written by steps since it was bound)
        self._pool_only = [(0, 0)] * num_rows
        self._keys: torch.Tensor | None = None  # [L, R, H_kv, C, D] the pool
        self._values: torch.Tensor | None = None  # [L, R, H_kv, C, D]
        self._graph: torch.cuda.CUDAGraph | None = None
        self._logits: torch.Tensor | None = None  # the graph's output buffer [R, vocab]

    @property
    def capacity(self) -> int:
        """Slots per row of the pool (0 before the first bind)."""
        return 0 if self._keys is None else self._keys.shape[3]

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds (beside the members' own caches)."""
        return 0 if self._keys is None else 2 * self._keys.nbytes

    def bind(self, caches: Sequence[KVCache]) -> list[int]:
        """Bind these caches (every slot each is to write already reserved by `extend`): the row of
        each. A cache bound before keeps its row; a new one is copied into a free row; a member not
        among `caches` is released. Where a cache outgrows the pool, the pool is made anew (and a
        captured graph is stale)."""
        if not 0 < len(caches) <= self.num_rows:
            raise ValueError(f"a bucket of {self.num_rows} rows takes 1 to {self.num_rows} sequences, "
                             f"not {len(caches)}")
        if not all(isinstance(c, KVCache) for c in caches):
            raise ValueError("the static batched step runs over the prefill's own caches (decode_cache model)")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("a cache appears twice in the batch")
        if max(c.length for c in caches) > self.capacity:
            self.release()
            self._allocate(max(c.capacity for c in caches))
        rows = {id(member): row for row, member in enumerate(self._members) if member is not None}
        wanted = {id(c) for c in caches}
        for row, member in enumerate(self._members):
            if member is not None and id(member) not in wanted:
                self._release_row(row)
        free = iter([row for row, member in enumerate(self._members) if member is None])
        out = []
        for cache in caches:
            row = rows.get(id(cache))
            if row is None:
                row = next(free)
                self._copy_in(row, cache)
            out.append(row)
        return out

    def load(self, rows: Sequence[int], token_ids: Sequence[int], positions: Sequence[int]) -> None:
        """The bound rows' tokens and positions (the padding rows: token 0 at slot 0 of their row)."""
        tokens, pos = [0] * self.num_rows, [0] * self.num_rows
        for row, token, position in zip(rows, token_ids, positions):
            tokens[row], pos[row] = token, position
            self._pool_only[row] = (self._pool_only[row][0], position + 1)  # the step writes the slot
        self._tokens.copy_(torch.tensor(tokens, dtype=torch.long))
        self._pos.copy_(torch.tensor(pos, dtype=torch.long))

    def static_step(self) -> torch.Tensor:
        """One step over the buffers and the pool: logits [R, vocab] (the padding rows' are meaningless)."""
        runner, num_rows = self.runner, self.num_rows
        group = runner.num_heads // runner.num_kv_heads
        hidden = runner.embed(self._tokens)  # [R, hidden]
        cos, sin = self._rope.cos.index_select(0, self._pos), self._rope.sin.index_select(0, self._pos)  # [R, D]
        unbiased = torch.where(self._slots[None, :] <= self._pos[:, None], self._zero, self._minus_inf)  # [R, C]
        biased = unbiased + self._bias  # [R, C]: each row's column bias (0 where it has none)
        for layer in range(runner.num_layers):
            q, k, v = runner.qkv(layer, hidden)  # [H, R, D], [H_kv, R, D] x2
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            keys, values = self._keys[layer], self._values[layer]  # [R, H_kv, C, D] each
            keys[self._row_ids, :, self._pos] = k.transpose(0, 1)  # [R, H_kv, D] at each row's position
            values[self._row_ids, :, self._pos] = v.transpose(0, 1)
            mask = torch.where(self._is_biased[layer], biased, unbiased)  # [R, C]
            # the G query heads of each KV head folded as G queries (as `_folded`): no K/V repeated
            folded = q.transpose(0, 1).reshape(num_rows, runner.num_kv_heads, group, runner.head_dim)
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask[:, None, None, :],
                                                 scale=runner.scaling)  # [R, H_kv, G, D]
            hidden = runner.finish(layer, hidden, out.reshape(num_rows, -1))  # out: [R, H*D]
        return runner.logits(hidden)  # [R, vocab]

    @torch.inference_mode()
    def step(self, caches: Sequence[KVCache], token_ids: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """Logits [B, vocab] of the B caches, in their order: on CUDA the bucket's graph replayed
        (captured where the pool is new), elsewhere `static_step` run eagerly."""
        rows = self.bind(caches)
        self.load(rows, token_ids, positions)
        order = torch.tensor(rows, device=self.runner.device)  # [B] the row of each cache
        if self.runner.device.type != "cuda":
            return self.static_step().index_select(0, order)
        if self._graph is None:
            self._graph, self._logits = capture_graph(self.runner.device, self.static_step)
        self._graph.replay()
        return self._logits.index_select(0, order)  # a copy: the buffer is overwritten by the next replay

    @torch.inference_mode()
    def release(self) -> None:
        """Copy every member's new K/V back into its cache and unbind it (the pool stays)."""
        for row, member in enumerate(self._members):
            if member is not None:
                self._release_row(row)

    def close(self) -> None:
        """Release the members, then free the pool and the graph (a later bind makes them anew)."""
        self.release()
        self._keys = self._values = self._graph = self._logits = self._bias = self._rope = None

    def _allocate(self, capacity: int) -> None:
        runner, rounding = self.runner, self.CAPACITY_ROUNDING
        capacity = -(-capacity // rounding) * rounding
        shape = (runner.num_layers, self.num_rows, runner.num_kv_heads, capacity, runner.head_dim)
        self._keys = self._values = self._graph = self._logits = None  # the old pool freed first
        # zeros: a slot no member wrote must be finite (NaN times a zero weight is NaN)
        self._keys = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        self._values = torch.zeros(shape, dtype=runner.dtype, device=runner.device)
        self._bias = torch.zeros(self.num_rows, capacity, dtype=runner.dtype, device=runner.device)  # [R, C]
        # [L, R, 1]: whether each row's bias applies at each layer (its cache's first biased layer on)
        self._is_biased = torch.zeros(runner.num_layers, self.num_rows, 1, dtype=torch.bool, device=runner.device)
        cos, sin = runner.rope(torch.arange(capacity, device=runner.device))  # [C, D] each
        self._rope = RopeTable(cos, sin)
        self._slots = torch.arange(capacity, device=runner.device)  # [C] slot numbers

    def _copy_in(self, row: int, cache: KVCache) -> None:
        """Bind `cache` to `row`: its slots into the pool, its column bias into the row's."""
        length = cache.length  # the last slot is reserved for this step: the step writes it
        self._keys[:, row, :, :length] = cache.keys[:, :, :length]
        self._values[:, row, :, :length] = cache.values[:, :, :length]
        self._bias[row].zero_()
        self._is_biased[:, row].fill_(False)
        if cache.column_bias is not None:
            bias = cache.column_bias.values[: self.capacity]
            self._bias[row, : bias.shape[0]] = bias
            self._is_biased[cache.column_bias.first_layer :, row] = True
        self._members[row], self._pool_only[row] = cache, (length - 1, length - 1)

    def _release_row(self, row: int) -> None:
        """The slots `row`'s member has written in the pool since it was bound, back into its cache."""
        cache, (start, end) = self._members[row], self._pool_only[row]
        cache.keys[:, :, start:end] = self._keys[:, row, :, start:end]
        cache.values[:, :, start:end] = self._values[:, row, :, start:end]
        self._members[row] = None


class DecodeBuckets:
    """The CUDA-graphed batched decode: `StaticBatch` buckets of 2, 4, ..., MAX_ROWS rows, one bound at
    a time (its pool is the memory it costs beside the sequences' caches). A batch takes the smallest
    bucket that fits it, and keeps its bucket while it shrinks to a quarter of its rows: a batch that
    crosses a bucket's size back and forth does not make pools and graphs anew at every crossing."""

    MAX_ROWS = 64

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._active: StaticBatch | None = None

    def fits(self, num_sequences: int) -> bool:
        return 1 <= num_sequences <= self.MAX_ROWS

    def step(self, decoders: Sequence[Decoder], token_ids: Sequence[int]) -> torch.Tensor:
        """Feed token_ids[b] after decoders[b]'s cache end, for every b: logits [B, vocab] (float32)."""
        if not self.fits(len(decoders)):
            raise ValueError(f"a bucket takes 1 to {self.MAX_ROWS} sequences, not {len(decoders)}")
        active = self._active
        if active is None or not active.num_rows // 4 < len(decoders) <= active.num_rows:
            self.close()
            num_rows = max(2, 1 << (len(decoders) - 1).bit_length())  # the next power of two
            self._active = active = StaticBatch(self.runner, num_rows)
        positions = [decoder.reserve() for decoder in decoders]
        return active.step([decoder.cache for decoder in decoders], token_ids, positions)

    def release(self) -> None:
        """Every bound cache whole again (its new K/V copied back): before another path decodes them."""
        if self._active is not None:
            self._active.release()

    def close(self) -> None:
        """Release, then free the bound bucket's pool and graph."""
        if self._active is not None:
            self._active.close()
            self._active = None
