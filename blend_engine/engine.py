"""BlendEngine: the engine's public face (precompute, prefill in four modes, generate, batched decode steps)."""

from __future__ import annotations

import functools
import inspect
from contextlib import AbstractContextManager
from typing import Callable, Generator, Iterator, Sequence, TypeVar

import torch

from blend_engine.attention import (BF16_MIN_KEYS, AttentionBackend, attend, avoid_cudnn_attention, causal_meta,
                                    last_meta, resolve_attention_dtype, subset_meta)
from blend_engine.batch_decode import DecodeBuckets, batch_step
from blend_engine.decode import Decoder
from blend_engine.decode_cache import resolve_decode_cache
from blend_engine.kv import ChunkKV, KVShape, LayerKVSource, MemoryKVSource, MergedKVSource
from blend_engine.loader import LoadedModel, load_model
from blend_engine.plan import plan_prefill
from blend_engine.prefill import last_part, prefill_steps
from blend_engine.prefill_graph import PrefillGraphs
from blend_engine.prompt import PromptBuilder, encode_text
from blend_engine.runner import ModelRunner, apply_rope
from blend_engine.sequence import DecodeSequence, TokenSampler
from blend_engine.threads import ThreadGovernor, governed
from blend_engine.types import BlendConfig, Delta, PrefillMode, PrefillResult, SamplingParams, Segment
from blend_engine.weights import weight_format
from blend_engine.weights_id import engine_fingerprint
from blend_engine.config import ModelConfig
from configs.enums import AttentionDtype, ChunkOrder, DecodeCache, SinkMode, WeightFormat

_Job = TypeVar("_Job", bound=Callable)
MAX_CACHED_PREFIXES = 16


def _on_cpu_threads(job: _Job) -> _Job:
    """Runs an engine method on the thread count its `threads` governor picks (CPU engines).

    A generator method (a prefill cut in parts) gets the count for each part it runs, as torch's own
    decorators hold their mode for each resumed part: calling a generator function runs none of its
    body, so a scope around the call alone would cover nothing, and a part resumed later would run on
    whatever count the thread was left with."""
    if inspect.isgeneratorfunction(job):
        @functools.wraps(job)
        def parts_on_threads(engine: BlendEngine, *args, **kwargs):
            return (yield from _each_part_in(lambda: governed(engine.threads), job(engine, *args, **kwargs)))
        return parts_on_threads  # type: ignore[return-value]

    @functools.wraps(job)
    def on_threads(engine: BlendEngine, *args, **kwargs):
        with governed(engine.threads):
            return job(engine, *args, **kwargs)
    return on_threads  # type: ignore[return-value]


def _each_part_in(scope: Callable[[], AbstractContextManager], parts: Generator) -> Generator:
    """`parts`' items, each computed inside a fresh `scope()`; closing this closes `parts` (its own
    clean-up, e.g. a KV source's, runs then, not whenever the garbage collector gets to it)."""
    try:
        while True:
            with scope():
                try:
                    part = next(parts)
                except StopIteration as stop:
                    return stop.value
            yield part
    finally:
        parts.close()


class BlendEngine:
    def __init__(
        self,
        loaded: LoadedModel,
        blend: BlendConfig = BlendConfig(),
        system_prompt: str = ModelConfig.system_prompt,
        cpu_threads: int | None = None,
        decode_cache: DecodeCache = DecodeCache.AUTO,
        max_cpu_threads: int | None = None,
        prefill_graphs: bool = ModelConfig.prefill_graphs,
        answer_instruction: str = ModelConfig.answer_instruction,
        chunk_order: ChunkOrder = ModelConfig.chunk_order,
        attention_dtype: AttentionDtype = ModelConfig.attention_dtype,
    ):
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.identity
        self.is_random = loaded.is_random
        self.runner = ModelRunner(self.model)
        self.blend = blend.fitted(self.runner.num_layers)
        self.weights = weight_format(self.model)  # what the linear layers hold (fp32: as loaded)
        self.attention_backend = AttentionBackend.for_device(self.runner.device)
        # what prefill attention computes in (ModelConfig.attention_dtype); decode keeps its own format
        choice = AttentionDtype(attention_dtype)
        self.attention_dtype = resolve_attention_dtype(choice, self.runner.device, self.runner.dtype,
                                                       self.weights != WeightFormat.FP32)
        self.min_cast_keys = BF16_MIN_KEYS if choice == AttentionDtype.AUTO else 0  # auto: long prefills only
        if self.runner.device.type == "cuda":
            avoid_cudnn_attention()  # a plan per prompt length: see there
        self.is_decode_graphed = self.runner.device.type == "cuda"  # CUDA-graph the decode step
        self.is_bulk_layout = self.runner.device.type == "cuda"  # reused KV laid out for all layers at once
        # a prefill's layers past blend's last check as CUDA graphs per token-count bucket (on CPU, tests
        # set it to run the same static functions eagerly)
        self.is_prefill_graphed = prefill_graphs and self.runner.device.type == "cuda"
        self.prefill_graphs = PrefillGraphs(self.runner)
        # what decode attends over: fp32 engines decode exactly over the prefill's cache
        self.decode_cache = resolve_decode_cache(
            decode_cache, self.runner.device, self.weights != WeightFormat.FP32, self.runner.head_dim)
        # CPU threads of each job and decode step (0: the cores other processes leave idle, at most
        # `max_cpu_threads`, default torch's count now; None: as the calling thread has them)
        is_governed = cpu_threads is not None and self.runner.device.type == "cpu"
        self.threads = ThreadGovernor(cpu_threads, max_threads=max_cpu_threads) if is_governed else None
        self.prompts = (PromptBuilder(self.tokenizer, system_prompt, answer_instruction, chunk_order)
                        if self.tokenizer is not None else None)
        self.fingerprint = engine_fingerprint(self)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        self._prefix_cache: dict[tuple[int, ...], ChunkKV] = {}  # LRU of prompt-prefix KVs
        # a batch of sequences decodes by a CUDA graph per bucket of rows over caches of the prefill's
        # format (on CPU, tests set it to run the same static step eagerly)
        self.is_batch_graphed = self.is_decode_graphed and self.decode_cache == DecodeCache.MODEL
        self._buckets = DecodeBuckets(self.runner)

    @classmethod
    def from_config(cls, model: ModelConfig, blend: BlendConfig = BlendConfig(),
                    max_cpu_threads: int | None = None) -> BlendEngine:
        return cls(load_model(model), blend, model.system_prompt, model.cpu_threads, model.decode_cache,
                   max_cpu_threads, model.prefill_graphs, model.answer_instruction, model.chunk_order,
                   model.attention_dtype)

    @classmethod
    def from_model(cls, model, tokenizer=None, name: str = "custom", **kwargs) -> BlendEngine:
        return cls(LoadedModel(model.eval(), tokenizer, identity=name), **kwargs)

    # --- shapes ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def attention_dtype_for(self, num_keys: int) -> torch.dtype:
        """What a prefill over `num_keys` keys attends in: `attention_dtype`, or under auto below
        BF16_MIN_KEYS the model's dtype."""
        return self.attention_dtype if num_keys >= self.min_cast_keys else self.dtype

    @property
    def num_layers(self) -> int:
        return self.runner.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.runner.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.runner.head_dim

    @property
    def kv_shape(self) -> KVShape:
        """What every chunk's KV holds besides its tokens: what the KV store checks its entries against."""
        return KVShape(self.num_layers, self.num_kv_heads, self.head_dim)

    @property
    def max_context(self) -> int:
        """Tokens a prompt and its answer may hold: the model's positions, and no more than its sliding
        attention window where it has one (Mistral's 4 096, a Qwen config with sliding layers): this
        engine lets every token attend to all earlier ones, which past the window is not the model's
        attention."""
        config = self.model.config
        limit = int(config.max_position_embeddings)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        is_sliding = ("sliding_attention" in layer_types if layer_types is not None
                      else getattr(config, "use_sliding_window", True))
        return min(limit, int(window)) if window and is_sliding else limit

    # --- prompts ----------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Document text -> ids; special-token parsing off, so text never yields control tokens."""
        return list(encode_text(self.tokenizer, text))

    def sink_ids(self, sink: SinkMode) -> tuple[int, ...]:
        """The context a chunk is precomputed behind (its KV is dropped)."""
        if sink == SinkMode.NONE:
            return ()
        if sink == SinkMode.BOS:
            bos = self.tokenizer.bos_token_id if self.tokenizer is not None else None
            return (bos,) if bos is not None else ()
        return self.prompts.prefix_ids()

    def build_segments(self, question: str, chunks: Sequence[Segment], history: Sequence[dict] = ()) -> list[Segment]:
        """RAG prompt segments. The prompt prefix (chat header, system prompt) carries its own exact
        KV, computed once per distinct prefix: what prefix caching would hold."""
        if self.prompts is None:
            raise ValueError("this engine has no tokenizer: pass segments of token ids")
        segments = self.prompts.segments(question, chunks, history)
        prefix = segments[0].token_ids
        return [Segment(prefix, self._prefix_kv(prefix)), *segments[1:]]

    def _prefix_kv(self, prefix_ids: tuple[int, ...]) -> ChunkKV:
        kv = self._prefix_cache.pop(prefix_ids, None) or self.precompute(prefix_ids)
        self._prefix_cache[prefix_ids] = kv  # most recent last
        while len(self._prefix_cache) > MAX_CACHED_PREFIXES:
            self._prefix_cache.pop(next(iter(self._prefix_cache)))
        return kv

    # --- compute ----------------------------------------------------------------------------------
    @_on_cpu_threads
    @torch.inference_mode()
    def precompute(self, token_ids: Sequence[int], context_ids: Sequence[int] = ()) -> ChunkKV:
        """The chunk's per-layer K (pre-RoPE) and V, computed behind `context_ids` only."""
        runner, context_ids, token_ids = self.runner, tuple(context_ids), tuple(token_ids)
        ids = torch.tensor(context_ids + token_ids, dtype=torch.long, device=self.device)
        n_ctx, n = len(context_ids), len(token_ids)
        shape = (runner.num_layers, runner.num_kv_heads, n, runner.head_dim)
        keys = torch.empty(shape, device=self.device, dtype=self.dtype)  # [L, H_kv, n, D]
        values = torch.empty(shape, device=self.device, dtype=self.dtype)
        if n:
            cos, sin = runner.rope(torch.arange(ids.numel(), device=self.device))
            hidden = runner.embed(ids)
            for layer in range(runner.num_layers):
                q, k, v = runner.qkv(layer, hidden)
                keys[layer], values[layer] = k[:, n_ctx:], v[:, n_ctx:]
                if layer == runner.num_layers - 1:
                    break  # the last layer's output feeds nothing stored
                meta = causal_meta(ids.numel(), self.attention_dtype_for(ids.numel()))
                out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, meta, runner.scaling)
                hidden = runner.finish(layer, hidden, out)
        return ChunkKV(token_ids, context_ids, keys, values)

    def prefill(
        self,
        segments: Sequence[Segment],
        mode: PrefillMode = PrefillMode.BLEND,
        blend: BlendConfig | None = None,
        kv_source: LayerKVSource | None = None,
        max_new_tokens: int = 0,
        is_profiled: bool = False,
    ) -> PrefillResult:
        """Prefill the prompt (in one go: `prefill_steps` run to its end).

        A segment's cache is either a ChunkKV in memory or a handle (e.g. the store's) whose layers
        `kv_source` delivers: it yields pairs for the non-ChunkKV segments only, in prompt order.
        `is_profiled` times each stage on CUDA (events); on CPU stages are always timed.
        """
        return last_part(self.prefill_steps(segments, mode, blend, kv_source, max_new_tokens, is_profiled))

    @_on_cpu_threads
    @torch.inference_mode()
    def prefill_steps(
        self,
        segments: Sequence[Segment],
        mode: PrefillMode = PrefillMode.BLEND,
        blend: BlendConfig | None = None,
        kv_source: LayerKVSource | None = None,
        max_new_tokens: int = 0,
        is_profiled: bool = False,
        max_step_token_layers: int | None = None,
    ) -> Generator[PrefillResult | None, None, None]:
        """`prefill` cut by layers (the rule: `blend_engine.prefill.prefill_steps`): None after each
        part, then the PrefillResult; each part runs in inference mode on the governor's threads.

        The in-memory side of the KV source is closed before the result is yielded, or when the
        generator is closed midway (`close()`: a cancelled request); `kv_source` stays the caller's
        to close, after the generator ends or is closed.
        """
        # a caller's own config built from the defaults (probe at layer 8) runs on a smaller model, probing at
        # its last layer as the engine's default does; the rest of the config is run as given
        segments, blend = list(segments), (blend or self.blend).probe_fitted(self.num_layers)
        plan = plan_prefill(segments, PrefillMode(mode), blend, self.num_layers)
        if plan.num_tokens + max_new_tokens > self.max_context:
            raise ValueError(f"prompt of {plan.num_tokens} tokens + {max_new_tokens} new exceeds "
                             f"the model's context of {self.max_context}")
        caches = [s.kv for s in segments if s.kv is not None]
        if all(isinstance(c, ChunkKV) for c in caches):
            source = MemoryKVSource(caches, self.device, self.dtype)
        elif kv_source is None:
            raise ValueError("segments hold store handles: pass the kv_source that loads them")
        else:
            source = MergedKVSource(caches, kv_source, self.device, self.dtype)
        parts = prefill_steps(self.runner, plan, blend, source, max_new_tokens, self.attention_backend, is_profiled,
                              self.is_bulk_layout, max_step_token_layers,
                              self.prefill_graphs if self.is_prefill_graphed else None,
                              self.attention_dtype_for(plan.num_tokens))
        try:
            for part in parts:
                if part is not None:
                    result = part
                    break
                yield None
            else:
                raise RuntimeError("the prefill ended without a result")
        finally:
            parts.close()
            source.close()  # a merged source leaves the caller's kv_source open
        yield result

    @_on_cpu_threads
    @torch.inference_mode()
    def forward_tokens(self, result: PrefillResult, token_ids: Sequence[int], is_last_only: bool = False) -> torch.Tensor:
        """Feed tokens after the cache's current end; logits [n, vocab] (float32) for each, or [1, vocab]
        for the last alone (`is_last_only`: a prompt fed in chunks needs no other; the lm_head over 512
        rows is ~30 GFLOP and a 100 MB tensor on SmolLM2)."""
        runner, cache, num_new = self.runner, result.cache, len(token_ids)
        start = cache.extend(num_new)
        positions = torch.arange(start, start + num_new, device=self.device)  # [n]
        hidden = runner.embed(torch.tensor(list(token_ids), dtype=torch.long, device=self.device))
        cos, sin = runner.rope(positions)

        dtype = self.attention_dtype_for(start + num_new)

        def meta_with(bias: torch.Tensor | None):
            return last_meta(start + 1, bias, dtype) if num_new == 1 else subset_meta(
                positions, start + num_new, self.attention_backend, runner.num_heads // runner.num_kv_heads,
                list(range(start, start + num_new)), dtype, bias)

        # a prefill that scaled the reused tokens' attention left its column bias on the cache
        plain = meta_with(None)
        biased = meta_with(cache.column_bias.values) if cache.column_bias is not None else plain
        for layer in range(runner.num_layers):
            q, k, v = runner.qkv(layer, hidden)
            keys, values = cache.update(layer, slice(start, start + num_new), apply_rope(k, cos, sin), v)
            meta = biased if cache.is_biased_at(layer) else plain
            hidden = runner.finish(layer, hidden, attend(apply_rope(q, cos, sin), keys, values, meta, runner.scaling))
        return runner.logits(hidden[-1:] if is_last_only else hidden)

    def decoder(
        self, result: PrefillResult, is_graphed: bool | None = None, cache_format: DecodeCache | None = None,
    ) -> Decoder:
        """A one-token-at-a-time decoder from the prompt's end (the cache is rewound there first);
        CUDA-graphed on CUDA unless `is_graphed` says otherwise; over the cache in `cache_format`
        (default: the engine's `decode_cache`; other than MODEL, a copy)."""
        result.cache.truncate(len(result.token_ids))
        graphed = self.is_decode_graphed if is_graphed is None else is_graphed
        fmt = self.decode_cache if cache_format is None else cache_format
        return Decoder(self.runner, result.cache, graphed, fmt, self.threads)

    def score(self, result: PrefillResult, target_ids: Sequence[int]) -> torch.Tensor:
        """Teacher forcing: logits [T, vocab] predicting each of `target_ids` after the prompt."""
        result.cache.truncate(len(result.token_ids))
        if len(target_ids) <= 1:
            return result.logits[None, :][: len(target_ids)]
        rest = self.forward_tokens(result, target_ids[:-1])
        return torch.cat([result.logits[None, :], rest], dim=0)

    # --- decoding: one sequence, or many in one batched step (a step scheduler) ---------------------
    def start_sequence(self, result: PrefillResult, sampling: SamplingParams = SamplingParams(),
                       ) -> tuple[DecodeSequence, Delta]:
        """Sample the first token from the prefill's logits (no model work): the request's sequence and
        the Delta for that token. Its decode cache is made later (`DecodeSequence.prepare`, or the first
        `decode_step`), so the copy is not in the time to first token. The cache is rewound to the
        prompt's end first."""
        result.cache.truncate(len(result.token_ids))
        room = self.max_context - result.cache.length
        if room <= 0:
            raise ValueError(f"the prompt fills the model's context of {self.max_context} tokens")
        sampler = TokenSampler(self.tokenizer, self.eos_ids, sampling, room, result.logits.device, result.token_ids)
        delta, next_token = sampler.push(result.logits)
        return DecodeSequence(result, sampler, next_token, self.decoder), delta

    @_on_cpu_threads
    def decode_step(self, sequences: Sequence[DecodeSequence]) -> list[Delta]:
        """One forward feeding every sequence's pending token (the linear layers on all B rows at once,
        attention per sequence over its own cache), then each samples its next token from its own row:
        one Delta per sequence, in order. A sequence's tokens do not depend on the others in the batch.
        On CUDA a batch of one replays the sequence's CUDA graph."""
        if not sequences:
            raise ValueError("decode_step needs at least one sequence")
        if any(s.is_finished for s in sequences):
            raise ValueError("a finished sequence cannot decode: leave it out of the batch")
        if len({id(s) for s in sequences}) != len(sequences):
            raise ValueError("a sequence appears twice in the batch")
        decoders = [s.prepare() for s in sequences]
        tokens = [s.next_token for s in sequences]
        if self.is_batch_graphed and len(decoders) > 1 and self._buckets.fits(len(decoders)):
            logits = self._buckets.step(decoders, tokens)  # [B, vocab]
        else:
            self._buckets.release()  # the caches a bucket holds whole again before another path reads them
            if len(decoders) == 1 and decoders[0].is_graphed:
                logits = decoders[0].step(tokens[0])[None]  # [1, vocab]
            else:
                logits = batch_step(self.runner, decoders, tokens)  # [B, vocab]
        deltas = [s.accept(row) for s, row in zip(sequences, logits)]
        if all(s.is_finished for s in sequences):
            self._buckets.close()  # nothing left to decode: the pool's memory goes back
        return deltas

    def close_decode_batch(self) -> None:
        """Nothing is decoding (the caller's word): the graphed batch's bucket gives its KV pool back,
        every cache it held whole again. A later `decode_step` makes one anew."""
        self._buckets.close()

    def generate(self, result: PrefillResult, sampling: SamplingParams = SamplingParams()) -> Iterator[Delta]:
        """Decode from the prompt's end (the cache is rewound there first): text pieces as they form
        (a sequence decoded alone: `start_sequence`, then `decode_step` on it until it finishes)."""
        sequence, delta = self.start_sequence(result, sampling)
        while True:
            if delta.text or delta.finish_reason is not None:
                yield delta
            if sequence.is_finished:
                return
            (delta,) = self.decode_step([sequence])


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update([configured] if isinstance(configured, int) else configured)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)

