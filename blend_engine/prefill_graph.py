"""A prefill's layers past blend's last check layer as CUDA graphs, captured per token-count bucket.

Past its last check a prefill computes the same active tokens at every layer (every layer, in reuse
and prefix modes; full mode's all tokens), so each layer's work has one shape for the rest of the
request. Run eagerly, that work is some 25 torch ops a layer, each a kernel launch on a GPU, and a
7B prefill was measured bound by them there (54 ms of host time for 18.5 ms of GPU work,
docs/benchmarks/gpu.md). Here the linear part of each layer is two graphs, replayed: `qkv` (the
input norm, q/k/v, RoPE on q and k) and `finish` (o_proj, the residual, the MLP), each over a
bucket's `rows` (the active tokens padded up: `bucket_rows`) in static buffers. What stays eager per
layer is what a request's own shapes decide, in few ops: the K/V written into the request's cache,
and the attention over its keys (whose count is the prompt's: one SDPA call).

Padding rows never mix with the real ones (every op in `qkv` and `finish` is row by row), so what
they hold does not matter. On CPU the same static functions run eagerly (the tests check them
against the eager prefill); on CUDA each bucket is captured once, for every layer, when first
asked for (the graphs share one memory pool: they replay one after the other, on one stream), and
the `MAX_BUCKETS` used last are kept. A bucket serves one prefill at a time: a prefill cut in parts
gives it back at each pause (`PrefillGraphs.release`), a second prefill asking for a bucket in use
runs eagerly.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from blend_engine.decode import NUM_WARMUP_STEPS
from blend_engine.runner import ModelRunner

log = logging.getLogger(__name__)

MIN_ROWS = 16  # the smallest bucket, and the rounding step of small ones
MAX_ROWS = 8192  # more active tokens than this run eagerly (a graph's buffers grow with its rows)
MAX_BUCKETS = 8  # buckets kept (their graphs and buffers), the most recently used


def bucket_rows(num_tokens: int) -> int:
    """The rows of the bucket that takes `num_tokens` active tokens: rounded up to a quarter of the
    power of two below it (four buckets per doubling, at most ~25% padding: 500 -> 512, 520 -> 640,
    3200 -> 3584), and to MIN_ROWS at least."""
    if num_tokens < 1:
        raise ValueError(f"a bucket holds at least one token, not {num_tokens}")
    step = max(MIN_ROWS, 1 << max(0, (num_tokens - 1).bit_length() - 3))
    return -(-num_tokens // step) * step


class PrefillBucket:
    """Static buffers of `rows` tokens and, on CUDA, each layer's two graphs over them."""

    def __init__(self, runner: ModelRunner, rows: int, replay_scope: Callable[[], AbstractContextManager]):
        self.runner, self.rows, self._replay_scope = runner, rows, replay_scope
        shape, device, dtype = runner.shape, runner.device, runner.dtype
        hidden_size = runner.model.config.hidden_size
        # zeros: the warm-up before a capture runs on them (finite in, finite out)
        self.hidden = torch.zeros(rows, hidden_size, device=device, dtype=dtype)  # [R, hidden] the layer's input
        self.cos = torch.zeros(rows, shape.head_dim, device=device, dtype=dtype)  # [R, D]
        self.signed_sin = torch.zeros(rows, shape.head_dim, device=device, dtype=dtype)  # [R, D]
        self.q = torch.zeros(shape.num_heads, rows, shape.head_dim, device=device, dtype=dtype)  # [H, R, D] rotated
        self.k = torch.zeros(shape.num_kv_heads, rows, shape.head_dim, device=device, dtype=dtype)  # rotated
        self.v = torch.zeros(shape.num_kv_heads, rows, shape.head_dim, device=device, dtype=dtype)
        self.attn = torch.zeros(rows, shape.num_heads * shape.head_dim, device=device, dtype=dtype)  # [R, H*D]
        self.num_tokens = 0  # the real rows, from `load`
        self._graphs: list[tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] | None = None

    @property
    def nbytes(self) -> int:
        """The static buffers' bytes (the graphs' pool comes on top, on CUDA)."""
        return sum(t.nbytes for t in (self.hidden, self.cos, self.signed_sin, self.q, self.k, self.v, self.attn))

    # --- what a graph replays -----------------------------------------------------------------------
    def static_qkv(self, layer: int) -> None:
        """q, k (rotated), v of every row, into their buffers."""
        q, k, v = self.runner.qkv(layer, self.hidden, (self.cos, self.signed_sin))
        self.q.copy_(q)
        self.k.copy_(k)
        self.v.copy_(v)

    def static_finish(self, layer: int) -> None:
        """The layer's output (o_proj of `attn`, the residual, the MLP) into `hidden`, its next input."""
        self.hidden.copy_(self.runner.finish(layer, self.hidden, self.attn))

    # --- what the prefill calls ---------------------------------------------------------------------
    def load(self, hidden: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        """The active tokens' hidden states [A, hidden] and RoPE rows [A, D] (A <= rows) into the buffers."""
        num = hidden.shape[0]
        if num > self.rows:
            raise ValueError(f"{num} tokens do not fit a bucket of {self.rows} rows")
        self.num_tokens = num
        self.hidden[:num].copy_(hidden)
        self.cos[:num].copy_(cos)
        self.signed_sin[:num].copy_(signed_sin)

    def qkv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's q [H, A, D], k, v [H_kv, A, D] of the loaded tokens (q and k rotated): views of
        the buffers, valid until the next call."""
        self._run(layer, 0)
        num = self.num_tokens
        return self.q[:, :num], self.k[:, :num], self.v[:, :num]

    def finish(self, layer: int, heads: torch.Tensor) -> None:
        """The layer's attention output heads [H, A, D] in, its output hidden states into `hidden`."""
        num = self.num_tokens
        # one copy: the heads laid side by side straight into the buffer's rows
        self.attn[:num].view(num, self.runner.num_heads, -1).transpose(0, 1).copy_(heads)
        self._run(layer, 1)

    def output(self) -> torch.Tensor:
        """The loaded tokens' hidden states [A, hidden] as the last `finish` left them (a view)."""
        return self.hidden[: self.num_tokens]

    def _run(self, layer: int, part: int) -> None:
        with self._replay_scope():
            if self._graphs is not None:
                self._graphs[layer][part].replay()
            elif part == 0:
                self.static_qkv(layer)
            else:
                self.static_finish(layer)

    def capture(self, pool: tuple[int, int]) -> None:
        """Every layer's two graphs (CUDA), after NUM_WARMUP_STEPS eager passes on a side stream (lazy
        cuBLAS and allocator set-up must not happen inside a capture). Thread-local capture: the KV
        store's loader thread may be copying on its own stream meanwhile."""
        device = self.runner.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(NUM_WARMUP_STEPS):
                for layer in range(self.runner.num_layers):
                    self.static_qkv(layer)
                    self.static_finish(layer)
        torch.cuda.current_stream(device).wait_stream(side)
        graphs = []
        for layer in range(self.runner.num_layers):
            pair = []
            for step in (self.static_qkv, self.static_finish):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    step(layer)
                pair.append(graph)
            graphs.append((pair[0], pair[1]))
        self._graphs = graphs

    @property
    def is_captured(self) -> bool:
        return self._graphs is not None


class PrefillGraphs:
    """The buckets of one engine's prefills: `acquire` the bucket for a count of active tokens (made,
    and on CUDA captured, the first time), `release` it when the prefill ends or pauses."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._buckets: OrderedDict[int, PrefillBucket] = OrderedDict()  # by rows, least recently used first
        self._in_use: set[int] = set()
        self._pool: tuple[int, int] | None = None
        # what each replay (or, off CUDA, each static call) runs inside: tests/dispatch_counts.py leaves
        # the ops a graph would replay out of its counts through it
        self.replay_scope: Callable[[], AbstractContextManager] = contextlib.nullcontext

    @property
    def buckets(self) -> list[int]:
        """The rows of the buckets kept, least recently used first."""
        return list(self._buckets)

    def acquire(self, num_tokens: int) -> PrefillBucket | None:
        """The bucket for `num_tokens` active tokens, now in use; None where there is none to be had
        (more than MAX_ROWS tokens, or that bucket in use by another prefill): run eagerly."""
        rows = bucket_rows(num_tokens)
        if rows > MAX_ROWS or rows in self._in_use:
            return None
        bucket = self._buckets.pop(rows, None)
        if bucket is None:
            bucket = self._make(rows)
        self._buckets[rows] = bucket  # most recently used last
        self._in_use.add(rows)
        return bucket

    def release(self, bucket: PrefillBucket) -> None:
        self._in_use.discard(bucket.rows)

    def close(self) -> None:
        """Drop every bucket not in use (their graphs and buffers)."""
        for rows in [r for r in self._buckets if r not in self._in_use]:
            del self._buckets[rows]

    def _make(self, rows: int) -> PrefillBucket:
        idle = [r for r in self._buckets if r not in self._in_use]
        while len(self._buckets) >= MAX_BUCKETS and idle:
            del self._buckets[idle.pop(0)]  # the least recently used idle bucket goes
        bucket = PrefillBucket(self.runner, rows, lambda: self.replay_scope())  # read at each replay
        if self.runner.device.type == "cuda":
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            bucket.capture(self._pool)
            log.debug("captured the prefill's layers for a bucket of %d rows", rows)
        return bucket
