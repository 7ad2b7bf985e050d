"""Decoding one token at a time after a prefill, doing no work a single token does not need.

The new token at position p sees every key 0..p, so it needs no mask; its RoPE row comes from a
table made once per request. On CPU the step runs eagerly over the cache's live length. On CUDA
every shape is static (the whole cache capacity, with a mask made on the device from the position
held in a device buffer), so the step is captured once as a CUDA graph and replayed: one launch per
token instead of hundreds, which is what keeps a 7B decode near the memory-bandwidth limit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from blend_engine.active import RopeTable
from blend_engine.attention import AttentionLayout, AttentionMeta, attend, attend_last, attend_last_int8, last_meta
from blend_engine.decode_cache import Int8Slots, decode_cache
from blend_engine.kv import KVCache, KVSlots
from blend_engine.layer import LayerCalls
from blend_engine.runner import ModelRunner, apply_rope, signed_sin
from blend_engine.threads import ThreadGovernor, governed
from configs.enums import DecodeCache

log = logging.getLogger(__name__)
NUM_WARMUP_STEPS = 2  # eager runs on a side stream before capture (lazy cuBLAS/allocator set-up)


# one query over the decode cache's layer (what its slots' `write` returns), by the cache's format,
# with the cache's column bias [N] at that layer or None: q [H, 1, D] -> [1, H*D]
Attend = Callable[[torch.Tensor, object, float, torch.Tensor | None], torch.Tensor]
_ATTENTION: dict[DecodeCache, Attend] = {
    # the new token sees every key: no mask
    DecodeCache.MODEL: lambda q, kv, scale, bias: attend(q, *kv, last_meta(kv[0].shape[1], bias), scale),
    DecodeCache.BF16: lambda q, kv, scale, bias: attend_last(q, *kv, scale, bias),  # bf16 matmuls (SDPA measured slower)
    DecodeCache.INT8: attend_last_int8,
}


def decode_layer(calls: LayerCalls, slots: KVSlots | Int8Slots, attend: Attend, hidden: torch.Tensor,
                 rope: tuple[torch.Tensor, torch.Tensor], pos: int, scale: float,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """One layer of the eager step: hidden [1, hidden] of the token at `pos` -> [1, hidden], its K/V
    written into `slots`; `bias` [pos + 1]: the cache's column bias at this layer, if any. Everything
    it reads is an argument of the same types for every layer (so torch.compile makes one graph for
    all of them: measured in the README, not used)."""
    q, k, v = calls.qkv(hidden, rope)  # [H, 1, D], [H_kv, 1, D] x2, q and k rotated
    return calls.finish(hidden, attend(q, slots.write(slice(pos, pos + 1), k, v, pos + 1), scale, bias))


class Decoder:
    def __init__(
        self, runner: ModelRunner, cache: KVCache, is_graphed: bool | None = None,
        cache_format: DecodeCache = DecodeCache.MODEL, threads: ThreadGovernor | None = None,
    ):
        """Decodes after `cache`'s end; in a `cache_format` other than MODEL, over a converted copy
        (the prefill's cache is left as it was); each step on the thread count `threads` picks (CPU)."""
        self.runner = runner
        self.threads = threads if runner.device.type == "cpu" else None
        self.is_graphed = runner.device.type == "cuda" if is_graphed is None else is_graphed
        if self.is_graphed and cache_format != DecodeCache.MODEL:
            raise ValueError(f"the graphed decode runs over the prefill's own cache, not {cache_format.value}")
        self.cache = decode_cache(cache, cache_format)
        self._attend = _ATTENTION[cache_format]
        self._rope, self._signed_sin = self._tables()
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_keys_ptr = 0  # the cache storage the graph was captured on

    def _tables(self) -> tuple[RopeTable, torch.Tensor]:
        """RoPE over the cache's capacity, and its signed sin [capacity, D] (the eager step's `rotate`)."""
        positions = torch.arange(self.cache.capacity, device=self.runner.device)
        cos, sin = self.runner.rope(positions)  # [capacity, D] each
        return RopeTable(cos, sin), signed_sin(sin)

    def step(self, token_id: int) -> torch.Tensor:
        """Feed one token after the cache's end; next-token logits [vocab] (float32)."""
        with governed(self.threads):  # re-chosen as the load changes, at most every min_interval_s
            return self._step(token_id)

    def reserve(self) -> int:
        """Reserve the next slot of the cache (growing it, and the RoPE tables, when full); its position."""
        pos = self.cache.extend(1)
        if self._rope.cos.shape[0] < self.cache.capacity:  # the cache grew: longer table (and graph)
            self._rope, self._signed_sin = self._tables()
        return pos

    def rope_rows(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [1, D] at `pos` (what `LayerCalls.qkv` rotates by)."""
        return self._rope.cos[pos : pos + 1], self._signed_sin[pos : pos + 1]

    def attend_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: int) -> torch.Tensor:
        """The token at `pos` (reserved): write its k, v [H_kv, 1, D] into the layer's slots and attend
        q [H, 1, D] over keys 0..pos with the cache's column bias -> [1, H*D]."""
        kv = self.cache.slots(layer).write(slice(pos, pos + 1), k, v, pos + 1)
        return self._attend(q, kv, self.runner.scaling, self.cache.bias_at(layer, pos + 1))

    @torch.inference_mode()
    def _step(self, token_id: int) -> torch.Tensor:
        pos = self.reserve()
        if not self.is_graphed:
            return self._eager(token_id, pos)
        if self._graph is None or self._graph_keys_ptr != self.cache.keys.data_ptr():
            self._capture(pos)
        self._token.fill_(token_id)
        self._pos.fill_(pos)
        self._graph.replay()
        return self._logits.clone()  # the static buffer is overwritten by the next replay

    def _eager(self, token_id: int, pos: int) -> torch.Tensor:
        runner = self.runner
        hidden = runner.embed(torch.tensor([token_id], device=runner.device))  # [1, hidden]
        rope = self._rope.cos[pos : pos + 1], self._signed_sin[pos : pos + 1]  # [1, D] each
        for layer in range(runner.num_layers):
            hidden = decode_layer(runner.calls[layer], self.cache.slots(layer), self._attend, hidden, rope, pos,
                                 runner.scaling, self.cache.bias_at(layer, pos + 1))
        return runner.logits(hidden)[0]

    # --- CUDA graph -------------------------------------------------------------------------------
    def static_step(self) -> torch.Tensor:
        """The step with static shapes, reading the token and position from device buffers."""
        runner, cache = self.runner, self.cache
        hidden = runner.embed(self._token)  # [1, hidden]
        cos, sin = self._rope.cos.index_select(0, self._pos), self._rope.sin.index_select(0, self._pos)  # [1, D]
        mask = torch.where(self._slots[None, :] <= self._pos[:, None], self._zero, self._minus_inf)  # [1, capacity]
        meta = AttentionMeta(AttentionLayout.SUBSET, cache.capacity, mask=mask)  # broadcast over folded heads
        biased = meta
        if cache.column_bias is not None:  # the whole capacity's: the slots past the prompt hold 0
            biased = AttentionMeta(AttentionLayout.SUBSET, cache.capacity, mask=mask + cache.column_bias.values)
        for layer in range(runner.num_layers):
            q, k, v = runner.qkv(layer, hidden)
            cache.keys[layer].index_copy_(1, self._pos, apply_rope(k, cos, sin))
            cache.values[layer].index_copy_(1, self._pos, v)
            layer_meta = biased if cache.is_biased_at(layer) else meta
            out = attend(apply_rope(q, cos, sin), cache.keys[layer], cache.values[layer], layer_meta, runner.scaling)
            hidden = runner.finish(layer, hidden, out)
        return runner.logits(hidden)[0]

    def prepare_static(self, pos: int) -> None:
        """The device buffers the static step reads (token, position, slot numbers)."""
        device = self.runner.device
        # the static step attends over the whole capacity, masked: slots not written yet must hold
        # finite values (uninitialised memory can be NaN, and NaN times a zero weight is NaN)
        with torch.inference_mode():  # the cache was made in inference mode
            self.cache.keys[:, :, pos:].zero_()
            self.cache.values[:, :, pos:].zero_()
        self._token = torch.zeros(1, dtype=torch.long, device=device)
        self._pos = torch.full((1,), pos, dtype=torch.long, device=device)
        self._slots = torch.arange(self.cache.capacity, device=device)
        self._zero = torch.zeros((), dtype=self.runner.dtype, device=device)
        self._minus_inf = torch.full((), float("-inf"), dtype=self.runner.dtype, device=device)

    def _capture(self, pos: int) -> None:
        self.prepare_static(pos)
        # warm-up writes K/V at slot `pos` only, which the first replay then overwrites
        self._graph, self._logits = capture_graph(self.runner.device, self.static_step)
        self._graph_keys_ptr = self.cache.keys.data_ptr()
        log.debug("captured the decode step for a cache of %d slots", self.cache.capacity)


# SDPA backends of a captured step, cuDNN's first: the engine turns it off for every other call (a plan
# per new shape: blend_engine/attention.py), but a graph has one shape, so its plan is made once, at
# capture. Measured on an H100 at Llama-2-7B shape (docs/benchmarks/gpu.md): the graphed decode over a
# 3.2k-token cache 8.6 ms per token with it, 12.2 ms with the memory-efficient kernel.
GRAPH_ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                            SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def capture_graph(device: torch.device, step: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`step` captured as a CUDA graph, after NUM_WARMUP_STEPS eager runs on a side stream (lazy cuBLAS
    and allocator set-up, and cuDNN's attention plans, must not happen inside the capture); the graph
    and its static output."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with sdpa_kernel(GRAPH_ATTENTION_BACKENDS, set_priority=True):
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_STEPS):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = step()
    return graph, output
