"""The caches a CPU decode step attends over when it is not the prefill's own (`DecodeCache`): a
bf16 copy (`KVCache.converted`), or `Int8KVCache`: keys and values in int8 with one scale per token
and KV head.

Why int8: one token's attention over a few thousand cached tokens is two thin matmuls per KV head
(a handful of query rows), which on CPU run far below memory bandwidth in bf16. torch's int8
weight-only kernel (`_weight_int8pack_mm`, which the int8 linear layers use too) runs both ~3x
faster (measured: README):
- scores = q @ K.T: the keys [N, D] are the kernel's weight, their per-token scales its per-row
  scales;
- out = p @ V: the weight is V transposed, [D, capacity], which the kernel needs contiguous, so it
  covers every slot of the capacity (kept a multiple of 32), the slots past the cache's length
  getting zero weight; the per-token scales of V are multiplied into p instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend_engine import native
from blend_engine.kv import KVCache, SlotCache
from configs.enums import DecodeCache

SCALE_DTYPE = torch.bfloat16  # the kernel's scales' (and activations') dtype
# the kernel's inner dimension (D for the scores, the capacity for p @ V) must be a multiple of 16:
# other sizes gave wrong sums or crashed (torch 2.13, measured); the capacity is kept a multiple of 32
KERNEL_MULTIPLE = 16
CAPACITY_MULTIPLE = 32
MAX_NATIVE_WRITE_ROWS = 32  # tokens a write takes through ragblend's kernel (`Int8Slots.write`)


@dataclass(frozen=True)
class Int8Layer:
    """One layer of an Int8KVCache, as the attention reads it (N = the cache's length)."""

    keys: torch.Tensor  # [H_kv, N, D] int8
    key_scales: torch.Tensor  # [H_kv, N] bf16: key = keys * scale
    values_t: torch.Tensor  # [H_kv, D, capacity] int8: every slot (those >= N get zero weight)
    value_scales: torch.Tensor  # [H_kv, N] bf16
    unit_scales: torch.Tensor  # [D] bf16 ones: p @ V's scales, already in p

    @property
    def num_keys(self) -> int:
        return self.keys.shape[1]

    def heads(self, group: int) -> Int8Heads:
        """Its KV heads, with zeroed p @ V weights for `group` queries per KV head."""
        probs = self.key_scales.new_zeros(self.keys.shape[0], group, self.values_t.shape[2])  # [H_kv, G, capacity]
        return Int8Heads(self.keys.unbind(0), self.key_scales.unbind(0), self.values_t.unbind(0),
                         self.value_scales[:, None], self.unit_scales, probs[..., : self.num_keys], probs.unbind(0))


@dataclass(frozen=True)
class Int8Heads:
    """One layer of an Int8KVCache cut into its KV heads, as the kernel takes them (2-D weights), and
    the buffer one token's p @ V weights go to (N = the keys it sees)."""

    keys: tuple[torch.Tensor, ...]  # per KV head [N, D] int8
    key_scales: tuple[torch.Tensor, ...]  # per KV head [N] bf16
    values_t: tuple[torch.Tensor, ...]  # per KV head [D, capacity] int8
    value_scales: torch.Tensor  # [H_kv, 1, N] bf16: broadcast over a KV head's queries
    unit_scales: torch.Tensor  # [D] bf16 ones
    probs: torch.Tensor  # [H_kv, G, N] bf16: p @ V's weights (written), the first N slots of a zeroed buffer
    prob_rows: tuple[torch.Tensor, ...]  # per KV head [G, capacity]: its rows (the kernel reads every slot)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> int8 [..., D] and scales [...] (bf16): symmetric absmax per row, the scale
    rounded to bf16 first so that `q * scale` is exactly what the kernel multiplies by."""
    scales = (x.abs().amax(-1) / 127).clamp_min(1e-8).to(SCALE_DTYPE)
    # x / scales: type promotion divides in x's dtype by the bf16 scales' exact values
    return torch.round(x / scales[..., None]).clamp_(-127, 127).to(torch.int8), scales


@dataclass(frozen=True)
class Int8Slots:
    """One layer of an Int8KVCache, as a step writes it (a plain argument: blend_engine/decode.py)."""

    keys: torch.Tensor  # [H_kv, capacity, D] int8
    key_scales: torch.Tensor  # [H_kv, capacity] bf16
    values_t: torch.Tensor  # [H_kv, D, capacity] int8
    value_scales: torch.Tensor  # [H_kv, capacity] bf16
    unit_scales: torch.Tensor  # [D] bf16 ones

    def write(self, index: slice, k: torch.Tensor, v: torch.Tensor, num_keys: int) -> Int8Layer:
        """Write k, v [H_kv, n, D] (k after RoPE) at slots `index`; returns the layer's first `num_keys`.
        A decode step's fp32 rows by ragblend's kernel where it is built (one call, `quantize_rows` bit for bit,
        where this made ~12 small ones: ~2 ms of a 1.5B step); a prompt's rows here (the kernel is one thread's
        scalar loop)."""
        is_native = (k.device.type == "cpu" and k.shape[1] <= MAX_NATIVE_WRITE_ROWS
                     and k.dtype == v.dtype == torch.float32 and k.stride(-1) == v.stride(-1) == 1)
        write = native.int8_write() if is_native else None
        if write is not None:
            write(k, v, self.keys, self.key_scales, self.values_t, self.value_scales, index.start or 0)
        else:
            num_kv_heads = k.shape[0]
            quantized, scales = quantize_rows(torch.cat([k, v]))  # [2 H_kv, n, D], [2 H_kv, n]: one pass for both
            self.keys[:, index], self.key_scales[:, index] = quantized[:num_kv_heads], scales[:num_kv_heads]
            self.values_t[:, :, index] = quantized[num_kv_heads:].transpose(1, 2)
            self.value_scales[:, index] = scales[num_kv_heads:]
        return Int8Layer(self.keys[:, :num_keys], self.key_scales[:, :num_keys], self.values_t,
                         self.value_scales[:, :num_keys], self.unit_scales)


@dataclass(frozen=True)
class Int8Step:
    """An Int8KVCache as one decode step reads and writes it, for the token at slot `pos`: every
    layer's views made up front by a few `unbind`s (~2 µs a view), where `Int8Slots.write` and
    `Int8Layer.heads` make them with a dozen slicing calls per layer (~5 µs each, per sequence and
    layer of a batched step). The views see the cache's storage: a layer's write at `pos` is what its
    attention then reads."""

    new_rows: tuple[tuple[torch.Tensor, ...], ...]  # per layer: slot pos of keys [H_kv, D], key_scales
    #                                                 [H_kv], values_t [H_kv, D] (a column), value_scales [H_kv]
    heads: tuple[Int8Heads, ...]  # per layer: its keys 0..pos cut per KV head, for torch's path (empty where
    #                               ragblend's kernel attends: it takes `layers`)
    layers: tuple[Int8Layer, ...]  # per layer: its keys 0..pos


def write_rows(steps: Sequence[Int8Step], layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [H_kv, B, D] (k after RoPE) of B tokens, token b's into `layer` of steps[b]'s cache at its
    slot: one quantization for the batch (per row: the same as `Int8Slots.write`'s), one copy call."""
    num_kv_heads = k.shape[0]
    quantized, scales = quantize_rows(torch.cat([k, v]))  # [2 H_kv, B, D] int8, [2 H_kv, B] bf16
    rows = zip(quantized[:num_kv_heads].unbind(1), scales[:num_kv_heads].unbind(1),  # per token: k [H_kv, D],
               quantized[num_kv_heads:].unbind(1), scales[num_kv_heads:].unbind(1))  # [H_kv], v, its scales
    # one call for the 4 B copies (the loop runs in C++): at B = 8, 32 Python-level copies per layer
    torch._foreach_copy_([t for step in steps for t in step.new_rows[layer]], [r for row in rows for r in row])


class Int8KVCache(SlotCache):
    """A decode cache (KVCache's `extend` / `update`) holding int8 keys and transposed int8 values."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, device: torch.device):
        capacity = -(-capacity // CAPACITY_MULTIPLE) * CAPACITY_MULTIPLE
        self.keys = torch.empty(num_layers, num_kv_heads, capacity, head_dim, dtype=torch.int8, device=device)
        self.values_t = torch.empty(num_layers, num_kv_heads, head_dim, capacity, dtype=torch.int8, device=device)
        self.key_scales = torch.empty(num_layers, num_kv_heads, capacity, dtype=SCALE_DTYPE, device=device)
        self.value_scales = torch.empty_like(self.key_scales)  # [L, H_kv, capacity]
        self.unit_scales = torch.ones(head_dim, dtype=SCALE_DTYPE, device=device)
        self.length = 0

    @classmethod
    def from_cache(cls, cache: KVCache) -> Int8KVCache:
        """`cache`'s `length` slots, quantized, at (at least) the same capacity."""
        num_layers, num_kv_heads, capacity, head_dim = cache.keys.shape
        out = cls(num_layers, num_kv_heads, head_dim, capacity, cache.keys.device)
        out.length = cache.length
        if cache.column_bias is not None:
            out.column_bias = cache.column_bias.grown(out.capacity)  # the capacity is rounded up
        for layer in range(num_layers):  # a layer at a time: the float temporaries stay one layer's size
            out.slots(layer).write(slice(0, cache.length), *cache.layer(layer), cache.length)
        return out

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.key_scales, self.values_t, self.value_scales

    def update(self, layer: int, index: slice, k: torch.Tensor, v: torch.Tensor) -> Int8Layer:
        """Write k, v [H_kv, n, D] (k after RoPE) at slots `index`; returns this layer's cache."""
        return self.slots(layer).write(index, k, v, self.length)

    def slots(self, layer: int) -> Int8Slots:
        return Int8Slots(self.keys[layer], self.key_scales[layer], self.values_t[layer], self.value_scales[layer],
                         self.unit_scales)

    def step(self, pos: int, group: int) -> Int8Step:
        """The views a decode step of the token at `pos` (reserved: `extend`) reads and writes, with
        `group` queries per KV head."""
        num_keys = pos + 1
        layers = tuple(Int8Layer(*parts, self.unit_scales) for parts in zip(
            self.keys[:, :, :num_keys].unbind(0), self.key_scales[:, :, :num_keys].unbind(0), self.values_t.unbind(0),
            self.value_scales[:, :, :num_keys].unbind(0)))
        heads = () if native.int8_attention() is not None else self._heads(num_keys, group)
        new_rows = tuple(zip(self.keys[:, :, pos].unbind(0), self.key_scales[:, :, pos].unbind(0),
                             self.values_t[..., pos].unbind(0), self.value_scales[:, :, pos].unbind(0)))
        return Int8Step(new_rows, heads, layers)

    def _heads(self, num_keys: int, group: int) -> tuple[Int8Heads, ...]:
        """Each layer's first `num_keys` cut per KV head, for torch's path (`attend_int8_heads`), the p @ V
        buffer shared (layers run in turn)."""
        num_kv_heads = self.keys.shape[1]

        def per_layer(t: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:  # [L * H_kv, ...] -> L tuples of H_kv
            views = t.unbind(0)
            return [views[i : i + num_kv_heads] for i in range(0, len(views), num_kv_heads)]

        keys = per_layer(self.keys[:, :, :num_keys].flatten(0, 1))  # [N, D] per layer and head
        key_scales = per_layer(self.key_scales[:, :, :num_keys].flatten(0, 1))  # [N]
        values_t = per_layer(self.values_t.flatten(0, 1))  # [D, capacity]
        value_scales = self.value_scales[:, :, None, :num_keys].unbind(0)  # [H_kv, 1, N] per layer
        probs = self.key_scales.new_zeros(num_kv_heads, group, self.capacity)  # [H_kv, G, capacity]
        probs_seen, prob_rows = probs[..., :num_keys], probs.unbind(0)  # [H_kv, G, N], [G, capacity] per head
        return tuple(Int8Heads(*parts, self.unit_scales, probs_seen, prob_rows)
                     for parts in zip(keys, key_scales, values_t, value_scales))

    def _grow(self, capacity: int) -> None:
        grown = Int8KVCache(self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], capacity, self.keys.device)
        n = self.length
        for name in ("keys", "key_scales", "value_scales"):
            getattr(grown, name)[:, :, :n] = getattr(self, name)[:, :, :n]
        grown.values_t[..., :n] = self.values_t[..., :n]
        self.keys, self.key_scales, self.value_scales, self.values_t = (
            grown.keys, grown.key_scales, grown.value_scales, grown.values_t)


def decode_cache(cache: KVCache, fmt: DecodeCache) -> KVCache | Int8KVCache:
    """The cache a decoder over `cache` in format `fmt` attends over (the prefill's is left as it was)."""
    if fmt == DecodeCache.MODEL:
        return cache
    if fmt == DecodeCache.BF16:
        return cache if cache.keys.dtype == torch.bfloat16 else cache.converted(torch.bfloat16)
    if fmt == DecodeCache.INT8:
        return Int8KVCache.from_cache(cache)
    raise ValueError(f"resolve decode cache {fmt.value!r} to a concrete one first")


def resolve_decode_cache(fmt: DecodeCache, device: torch.device, is_quantized: bool, head_dim: int) -> DecodeCache:
    """auto: for quantized weights on CPU, int8 where the kernel takes the head size, else bf16
    (measured: README); else the prefill's cache."""
    if fmt == DecodeCache.AUTO:
        if device.type != "cpu" or not is_quantized:
            return DecodeCache.MODEL
        return DecodeCache.INT8 if head_dim % KERNEL_MULTIPLE == 0 else DecodeCache.BF16
    if fmt != DecodeCache.MODEL and device.type != "cpu":
        raise ValueError(f"model.decode_cache {fmt.value} runs on CPU only (CUDA decodes over the prefill's cache)")
    if fmt == DecodeCache.INT8 and head_dim % KERNEL_MULTIPLE != 0:
        raise ValueError(f"model.decode_cache int8 needs a head size divisible by {KERNEL_MULTIPLE}, not {head_dim}")
    return fmt
