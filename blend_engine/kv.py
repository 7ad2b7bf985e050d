"""KV containers: a chunk's stored cache (`ChunkKV`), the per-request fused cache (`KVCache`), a
finished prompt's cache kept for later requests (`PromptKV`), and the per-layer source the prefill
reads reused KV from (`LayerKVSource`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class KVShape:
    """A model's KV besides the token axis: every chunk it computes has keys and values
    [num_layers, num_kv_heads, num_tokens, head_dim]. A store holds entries of its model's shape only."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if min(self.num_layers, self.num_kv_heads, self.head_dim) < 1:
            raise ValueError(f"a KV shape has at least one layer, KV head and head dim: {self}")


@dataclass(frozen=True)
class ChunkKV:
    """A chunk's KV, computed on the chunk alone (behind `context_ids`, whose own KV is dropped).

    Keys are stored *before* RoPE, so the chunk can be placed at any position by rotating
    them with the model's own rotary embedding at the target positions.
    """

    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...]  # the attention-sink prefix it was computed behind
    keys: torch.Tensor  # [num_layers, num_kv_heads, num_tokens, head_dim], pre-RoPE
    values: torch.Tensor  # [num_layers, num_kv_heads, num_tokens, head_dim]
    # The KV store's namespace it is stored under (a collection's salt, part of its key: kv_store/keys.py),
    # carried so a stored copy records it; the engine never reads it.
    salt: str = ""

    def __post_init__(self) -> None:
        if self.keys.shape != self.values.shape or self.keys.dim() != 4:
            raise ValueError(f"keys {tuple(self.keys.shape)} and values {tuple(self.values.shape)} must match, 4-D")
        if self.keys.shape[2] != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} tokens but KV for {self.keys.shape[2]}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def shape(self) -> KVShape:
        return KVShape(self.keys.shape[0], self.keys.shape[1], self.keys.shape[3])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ChunkKV:
        return ChunkKV(self.token_ids, self.context_ids, self.keys.to(device, dtype), self.values.to(device, dtype),
                       self.salt)


class CachedChunk(Protocol):
    """What the prefill needs to know of a segment's reused KV before its layers arrive."""

    @property
    def context_ids(self) -> tuple[int, ...]: ...

    @property
    def num_tokens(self) -> int: ...


class LayerKVSource(Protocol):
    """Reused KV of a prompt's cached segments, delivered one layer at a time, in layer order.

    The prefill asks for layer 0, 1, ... in turn, so a source may prefetch layer i+1 while the
    engine computes layer i (see kv_store's pipelined loader).
    """

    def layer(self, layer_idx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (keys_pre_rope, values) pair per cached segment, in prompt order; each [num_kv_heads, n, head_dim]."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WholeKVSource(Protocol):
    """A source holding every layer at once: the prefill lays all of them out before its loop."""

    def layers_from(self, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per cached segment, (keys_pre_rope, values) [num_layers - start, num_kv_heads, n, head_dim]."""
        ...


class MemoryKVSource:
    """A `LayerKVSource` (and `WholeKVSource`) over ChunkKVs already in memory."""

    def __init__(self, chunks: Sequence[ChunkKV], device: torch.device, dtype: torch.dtype):
        self._chunks = list(chunks)
        self._device, self._dtype = device, dtype

    def layer(self, layer_idx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (c.keys[layer_idx].to(self._device, self._dtype), c.values[layer_idx].to(self._device, self._dtype))
            for c in self._chunks
        ]

    def layers_from(self, start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # no copy here: the prefill copies each chunk straight into its slice of the fused cache
        return [(c.keys[start:], c.values[start:]) for c in self._chunks]

    def close(self) -> None:
        self._chunks = []


class MergedKVSource:
    """Memory ChunkKVs and an external source (e.g. the store's pipelined loader), in prompt order.

    The external source delivers only the segments whose cache is not an in-memory ChunkKV.
    """

    def __init__(self, caches: Sequence[object], external: LayerKVSource, device: torch.device, dtype: torch.dtype):
        self._is_memory = [isinstance(c, ChunkKV) for c in caches]
        self._memory = MemoryKVSource([c for c in caches if isinstance(c, ChunkKV)], device, dtype)
        self._external = external

    def layer(self, layer_idx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        memory = iter(self._memory.layer(layer_idx))
        external = iter(self._external.layer(layer_idx))
        return [next(memory) if is_memory else next(external) for is_memory in self._is_memory]

    def close(self) -> None:
        self._memory.close()  # the external source belongs to the caller


@dataclass(frozen=True)
class ColumnBias:
    """An additive attention-logit bias per cache slot, at layers `first_layer`.. : how a prefill
    that scaled the reused tokens' attention (BlendConfig.reused_attention_scale) has every later
    token (scoring, decoding) attend to them the same way."""

    values: torch.Tensor  # [capacity] in the attention's dtype; 0 for every slot past the prompt
    first_layer: int

    def at(self, layer: int, num_keys: int) -> torch.Tensor | None:
        """[num_keys] the bias at `layer`, None where it has none."""
        return self.values[:num_keys] if layer >= self.first_layer else None

    def grown(self, capacity: int) -> ColumnBias:
        return ColumnBias(torch.nn.functional.pad(self.values, (0, capacity - self.values.shape[0])), self.first_layer)


class SlotCache:
    """Slots 0..length-1 of a cache whose `keys` are [L, H_kv, capacity, ...]: reserving slots, growing
    (by `_grow`, each cache's own layout) when they run out. KVCache and the int8 decode cache share it."""

    keys: torch.Tensor
    length: int
    column_bias: ColumnBias | None = None  # set by a prefill with a reused attention scale
    # >0: the slots are a kept prompt's (PromptKV.shared): the first `extend`, which every write follows,
    # copies them into a cache of its own of at least this capacity (copy on write)
    copy_on_write_capacity: int = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def extend(self, num_tokens: int) -> int:
        """Reserve the next `num_tokens` slots (growing if needed, or copying shared slots first);
        returns the first one's position."""
        needed = self.length + num_tokens
        if self.copy_on_write_capacity:
            self._grow(max(needed, self.copy_on_write_capacity))
            self.copy_on_write_capacity = 0
        elif needed > self.capacity:
            self._grow(max(needed, 2 * self.capacity))
        if self.column_bias is not None and self.column_bias.values.shape[0] < self.capacity:
            self.column_bias = self.column_bias.grown(self.capacity)
        start, self.length = self.length, needed
        return start

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds (its whole capacity, every buffer), e.g. for a KV budget."""
        return sum(t.nbytes for t in self._buffers())

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def bias_at(self, layer: int, num_keys: int) -> torch.Tensor | None:
        """[num_keys] the column bias at `layer`, or None."""
        return None if self.column_bias is None else self.column_bias.at(layer, num_keys)

    def is_biased_at(self, layer: int) -> bool:
        return self.column_bias is not None and layer >= self.column_bias.first_layer

    def _grow(self, capacity: int) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class KVSlots:
    """One layer of a KVCache, as a step writes it (a plain argument: blend_engine/decode.py)."""

    keys: torch.Tensor  # [H_kv, capacity, D]
    values: torch.Tensor  # [H_kv, capacity, D]

    def write(
        self, index: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor, num_keys: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [H_kv, n, D] at slots `index`; returns K, V [H_kv, num_keys, D]."""
        self.keys[:, index] = k
        self.values[:, index] = v
        return self.keys[:, :num_keys], self.values[:, :num_keys]


class KVCache(SlotCache):
    """A request's fused KV cache (post-RoPE keys), batch size 1, preallocated to `capacity` tokens."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        device: torch.device,
        dtype: torch.dtype,
    ):
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        # empty, not zeros: every slot below `length` is written before it is read
        self.keys = torch.empty(shape, device=device, dtype=dtype)  # [L, H_kv, capacity, D]
        self.values = torch.empty(shape, device=device, dtype=dtype)  # [L, H_kv, capacity, D]
        self.length = 0

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return self.keys, self.values

    def truncate(self, length: int) -> None:
        """Forget every slot from `length` on (e.g. to decode again from the prompt's end)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {length}")
        self.length = length

    def _grow(self, capacity: int) -> None:
        def grown(t: torch.Tensor) -> torch.Tensor:
            out = t.new_empty((*t.shape[:2], capacity, t.shape[3]))
            out[:, :, : self.length] = t[:, :, : self.length]
            return out

        self.keys, self.values = grown(self.keys), grown(self.values)

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, length: int, column_bias: ColumnBias | None,
             copy_on_write_capacity: int = 0) -> KVCache:
        """A cache over existing tensors [L, H_kv, capacity, D] whose first `length` slots are filled."""
        cache = cls.__new__(cls)
        cache.keys, cache.values, cache.length, cache.column_bias = keys, values, length, column_bias
        cache.copy_on_write_capacity = copy_on_write_capacity
        return cache

    def converted(self, dtype: torch.dtype) -> KVCache:
        """A copy in `dtype` of the same capacity, holding this cache's `length` slots."""
        out = KVCache(self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], self.capacity, self.keys.device, dtype)
        out.keys[:, :, : self.length] = self.keys[:, :, : self.length]
        out.values[:, :, : self.length] = self.values[:, :, : self.length]
        out.length, out.column_bias = self.length, self.column_bias
        return out

    def update(
        self, layer: int, index: torch.Tensor | slice, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [H_kv, n, D] at slots `index` ([n] or a slice); returns this layer's K, V [H_kv, length, D]."""
        return self.slots(layer).write(index, k, v, self.length)

    def slots(self, layer: int) -> KVSlots:
        return KVSlots(self.keys[layer], self.values[layer])

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K, V [H_kv, length, D]."""
        return self.keys[layer, :, : self.length], self.values[layer, :, : self.length]


@dataclass(frozen=True)
class PromptKV:
    """A finished prompt's fused KV, kept for later requests (a prefix cache's entry): slots
    0..length-1 of `keys`/`values`, post-RoPE, with the column bias its prefill left. Those slots are
    never written again: the request that made them may still decode into the slots after `length`
    (its own), and every later user reads a copy-on-write view (`shared`) or a copy (`copied`)."""

    keys: torch.Tensor  # [L, H_kv, capacity, D]: slots >= length belong to the request that made it
    values: torch.Tensor  # [L, H_kv, capacity, D]
    length: int
    column_bias: ColumnBias | None = None  # values [capacity]

    @classmethod
    def of(cls, cache: KVCache, length: int) -> PromptKV:
        """`cache`'s first `length` slots, by reference (no copy); a copy of them alone where the
        cache's room past them exceeds their own size (a long answer's room is not kept)."""
        if not 0 < length <= cache.length:
            raise ValueError(f"cannot keep {length} slots of a cache of {cache.length}")
        keys, values, bias = cache.keys, cache.values, cache.column_bias
        if cache.capacity > 2 * length:
            keys, values = keys[:, :, :length].clone(), values[:, :, :length].clone()
            bias = None if bias is None else ColumnBias(bias.values[:length].clone(), bias.first_layer)
        return cls(keys, values, length, bias)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """What keeping it holds: its tensors' whole capacity."""
        bias = self.column_bias.values.nbytes if self.column_bias is not None else 0
        return self.keys.nbytes + self.values.nbytes + bias

    def shared(self, capacity: int = 0) -> KVCache:
        """A cache over all `length` slots, sharing their storage: its first `extend` (every write, a
        decode step's too, comes after one) copies them into a cache of its own of at least `capacity`
        slots (default: this one's). Nothing is copied for a request that only reads them (the first
        token, a decode over a converted copy)."""
        return KVCache.over(self.keys, self.values, self.length, self.column_bias, max(capacity, self.capacity))

    def copied(self, length: int, capacity: int) -> KVCache:
        """A cache of `capacity` slots holding a copy of the first `length` (the rest to be computed)."""
        if not 0 < length <= self.length or capacity < length:
            raise ValueError(f"cannot copy {length} of {self.length} slots into a cache of {capacity}")
        shape = (self.keys.shape[0], self.keys.shape[1], capacity, self.keys.shape[3])
        keys = self.keys.new_empty(shape)  # empty: every slot past `length` is written before it is read
        values = self.values.new_empty(shape)
        keys[:, :, :length] = self.keys[:, :, :length]
        values[:, :, :length] = self.values[:, :, :length]
        bias = None
        if self.column_bias is not None:  # the tokens computed after them are fresh: no bias there
            bias = ColumnBias(F.pad(self.column_bias.values[:length], (0, capacity - length)),
                              self.column_bias.first_layer)
        return KVCache.over(keys, values, length, bias)
