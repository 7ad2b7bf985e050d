"""The per-request executor: a request's prompt -> segments with their stored KV -> the loading
planner's choice -> the engine's prefill. Runs on the engine loop's thread only (it calls the model).

A long prefill runs in parts, one per scheduler step (`prefill_steps` yields None between them), so
the sequences already decoding keep streaming and stall for one part, never for a whole prompt:
- a full prefill (a request's `mode: full`, the loading planner's own full plan, or mode auto where no
  chunk has stored KV) longer than `prefill_chunk_tokens` is cut into token chunks: each chunk runs
  over the cache the earlier chunks filled (`BlendEngine.forward_tokens`), which computes what one
  full prefill computes;
- every other prefill (blend, reuse, prefix) is cut by layers (`BlendEngine.prefill_steps`): a part
  ends once its layers' active tokens add up to `prefill_chunk_tokens` x the model's layers, the work
  of one full chunk counted in token-layers (a 3k-token blend prefill on SmolLM2's 30 layers computes
  all 3k tokens at its check layer, ~500 at each later one: 2 parts at 512, 5 at 128), the known rest
  shared evenly once the last check is past. It runs the same ops in the same order as one prefill,
  so its result is the same. The store's KV source (and its loader thread) stays open across the
  parts and is closed when the prefill ends or its generator is closed (a cancelled request,
  shutdown).

With a prefix cache (`prefix_cache`, the store's `prompts`), a finished prompt's KV is kept once its
first token is out (`keep`), and a later prompt first looks for its longest kept prefix:
- the whole prompt kept: nothing is computed; the request decodes from a copy-on-write view of the
  kept KV with the kept logits (the same first token, and greedy, the same answer);
- a prefix kept (a chat's follow-up over the same documents: the earlier turn's whole prompt): its KV
  is copied and only the rest is fed over it (`BlendEngine.forward_tokens`, in token chunks as a full
  prefill), when the loading planner predicts that sooner than the plan it would run otherwise (a
  RAG prompt sharing only the system prompt: today's plan, its documents blended);
- a kept prompt serves only requests asking for the same prefill (mode, ratio and selection, as asked:
  a full prefill's serves full requests, a blend's blend requests), so an answer never comes from KV
  computed otherwise than it asked; requests of another `namespace` never meet."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Generator, Protocol, Sequence

import torch

from blend_engine.engine import BlendEngine
from blend_engine.kv import ChunkKV, PromptKV
from blend_engine.types import BlendConfig, PrefillMode, PrefillResult, PrefillStats, Segment
from configs.enums import RequestMode
from kv_store import KVStore
from kv_store.loader import StoredChunk, StoreLayerSource, handles_in
from kv_store.planner import LoadPlan, PlanKind, PlanRequest, PrefillShape
from kv_store.prefix_cache import PrefixCache, PrefixMatch
from runtime.config import SchedulerConfig
from runtime.planning import PlanReport, compute_seconds, measure_engine, planned_segments, shape_of
from runtime.types import PrefillRequest, PromptChunk, Usage

logger = logging.getLogger(__name__)


class Repairer(Protocol):
    def schedule(self, key: str, token_ids: Sequence[int], context_ids: Sequence[int]) -> bool: ...


@dataclass(frozen=True)
class KeptPrompt:
    """A prefix cache entry's value: a finished prompt's KV, its next-token logits, the mode that made it."""

    kv: PromptKV
    logits: torch.Tensor  # [vocab] float32
    mode: PrefillMode  # how its KV was computed: what the requests it serves report

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.logits.nbytes


@dataclass(frozen=True)
class PromptToKeep:
    """Where a finished prompt goes in the prefix cache (`PrefillExecutor.keep`)."""

    namespace: str
    kind: str  # the prefill its request asked for (`prefill_kind`): the requests it serves ask the same
    chunk_keys: frozenset[str]  # the stored chunks it holds: a change to one of them drops it
    mode: PrefillMode
    epoch: int  # the prefix cache's epoch when its chunks were chosen: not kept if one changed since


@dataclass
class PrefillOutcome:
    result: PrefillResult
    handles: list[StoredChunk]  # the store handles its KV was streamed from (promoted after the answer)
    plan: PlanReport | None  # the loading planner's plan, where it chose
    keep: PromptToKeep | None = None  # where the prompt goes in the prefix cache once its first token is out
    # The prompt's opening (chat header, system prompt) run on the KV the engine keeps for it: reused in
    # the engine's stats (laid out, not computed), but no stored chunk's, so computed in `usage`.
    num_opening_tokens: int = 0

    @property
    def usage(self) -> Usage:
        """The prompt's tokens by where their KV came from, each once (docs/api.md): `reused_tokens` a
        stored chunk's, `prefix_cached_tokens` the prefix cache's, `recomputed_tokens` the rest; the
        opening's KV is computed by the engine, once per distinct opening, so it counts as computed."""
        stats = self.result.stats
        return Usage(stats.num_prompt_tokens, stats.num_reused_tokens - self.num_opening_tokens,
                     stats.num_recomputed_tokens + self.num_opening_tokens,
                     prefix_cached_tokens=stats.num_prefix_cached_tokens)


@dataclass
class PrefillExecutor:
    engine: BlendEngine
    kv_store: KVStore
    blend: BlendConfig  # as configured; each request's is fitted to the engine's layers (`request_config`)
    profile_tokens: Sequence[int]  # the start-up measurement's prompt sizes (store.planner_profile_tokens)
    prefill_chunk_tokens: int = SchedulerConfig.prefill_chunk_tokens
    repairer: Repairer | None = None  # recomputes, in the background, the entries found missing
    prefix_cache: PrefixCache[KeptPrompt] | None = None  # finished prompts' KV (None: none kept)

    def prefill_steps(self, request: PrefillRequest) -> Generator[PrefillOutcome | None, None, None]:
        """The prefill, in one step or (a long one) several: None after each part but the last, then
        the outcome. Close the generator to abandon it midway: its KV source is closed then."""
        if self._is_prefix_cached(request) and request.prefix_cache_epoch is None:
            request = replace(request, prefix_cache_epoch=self.prefix_cache.epoch)
        match, token_ids = self._lookup(request)
        if match is not None and match.is_whole:
            yield self._whole_prompt_kept(request, match, token_ids)
            return
        is_full = request.mode is RequestMode.FULL
        segments = self._segments(request, with_kv=not is_full)
        handles = handles_in(segments)
        blend = self.request_config(request)  # its check layer decides where stored KV is read from
        num_cached = 0 if match is None else min(match.num_tokens, len(token_ids) - 1)  # the last is computed
        mode, plan = self._plan(request, segments, handles, blend.first_check_layer, num_cached)
        if plan is not None and plan.kind is PlanKind.PREFIX_CACHE:
            yield from self._prefix_kept(request, match, num_cached, token_ids, handles, plan)
            return
        if token_ids is not None:
            self.prefix_cache.record(match, 0)  # looked up, nothing reused
        if plan is not None and plan.ratio is not None and request.recompute_ratio in (None, "auto"):
            blend = replace(blend, recompute_ratio=plan.ratio)  # the planner's: what the loads hide
        num_tokens = sum(len(s.token_ids) for s in segments)
        if mode is PrefillMode.FULL and num_tokens > self.prefill_chunk_tokens:
            parts = self._chunked_full(request, segments, handles, plan, blend.first_check_layer)
        else:
            parts = self._prefill(request, segments, handles, mode, plan, blend)
        yield from self._keeping(request, parts)

    # --- the prefix cache -------------------------------------------------------------------------
    def _is_prefix_cached(self, request: PrefillRequest) -> bool:
        return self.prefix_cache is not None and self.prefix_cache.is_enabled and request.is_prefix_cache_used

    def _lookup(self, request: PrefillRequest) -> tuple[PrefixMatch[KeptPrompt] | None, tuple[int, ...] | None]:
        """The longest kept prefix of the request's prompt and the prompt's token ids (tokenized
        without model work); (None, None) where the prefix cache is off for it."""
        if not self._is_prefix_cached(request):
            return None, None
        token_ids = tuple(t for s in self._segments(request, with_kv=False) for t in s.token_ids)
        return self.prefix_cache.lookup(request.namespace, (prefill_kind(request),), token_ids), token_ids

    def _check_context(self, num_tokens: int, max_new_tokens: int) -> None:
        if num_tokens + max_new_tokens > self.engine.max_context:  # as the engine's prefill refuses it
            raise ValueError(f"prompt of {num_tokens} tokens + {max_new_tokens} new exceeds "
                             f"the model's context of {self.engine.max_context}")

    def _whole_prompt_kept(self, request: PrefillRequest, match: PrefixMatch[KeptPrompt],
                           token_ids: tuple[int, ...]) -> PrefillOutcome:
        """The prompt is kept whole: its KV (a copy-on-write view: decoding copies it first, a decode
        over a converted copy never) and its logits, nothing computed."""
        start = time.perf_counter()
        kept, num_tokens = match.entry.value, len(token_ids)
        self._check_context(num_tokens, request.sampling.max_tokens)
        cache = kept.kv.shared(num_tokens + request.sampling.max_tokens)
        elapsed_ms = (time.perf_counter() - start) * 1000
        stats = PrefillStats(kept.mode, num_prompt_tokens=num_tokens, num_prefix_cached_tokens=num_tokens,
                             compute_ms=elapsed_ms, prefill_ms=elapsed_ms)
        self.prefix_cache.record(match, num_tokens)
        return PrefillOutcome(PrefillResult(list(token_ids), cache, kept.logits, stats), [], None)

    def _prefix_kept(self, request: PrefillRequest, match: PrefixMatch[KeptPrompt], num_cached: int,
                     token_ids: tuple[int, ...], handles: list[StoredChunk],
                     plan: LoadPlan) -> Generator[PrefillOutcome | None, None, None]:
        """The first `num_cached` tokens' kept KV copied, the rest fed over it `prefill_chunk_tokens` at
        a time (causal over everything before: what a full prefill of them computes over that KV). The
        stored chunks' handles (opened for the planner, unread) go with the outcome: promoted and let go
        after the answer, as a mixed plan's unread ones."""
        kept, num_tokens, chunk = match.entry.value, len(token_ids), self.prefill_chunk_tokens
        max_new_tokens = request.sampling.max_tokens
        self._check_context(num_tokens, max_new_tokens)
        t_start, elapsed_s = time.perf_counter(), 0.0
        result = PrefillResult(list(token_ids), kept.kv.copied(num_cached, num_tokens + max_new_tokens),
                               kept.logits, PrefillStats(kept.mode))
        for start in range(num_cached, num_tokens, chunk):
            if start > num_cached:
                elapsed_s += time.perf_counter() - t_start
                yield None  # the running sequences decode a step before the next chunk
                t_start = time.perf_counter()
            result.logits = self.engine.forward_tokens(result, token_ids[start:start + chunk], is_last_only=True)[0]
        elapsed_s += time.perf_counter() - t_start
        num_computed = num_tokens - num_cached
        result.stats = PrefillStats(kept.mode, num_prompt_tokens=num_tokens, num_recomputed_tokens=num_computed,
                                    num_prefix_cached_tokens=num_cached, compute_ms=elapsed_s * 1000,
                                    prefill_ms=elapsed_s * 1000)
        # as the planner predicts it: the kept tokens copied, not laid out (LoadPlanner.prefix_cached)
        self.kv_store.planner.observe(PrefillShape(num_tokens, num_computed, 0, 1.0), elapsed_s)
        self.prefix_cache.record(match, num_cached)
        report = PlanReport.of(plan, 0, 0.0, result.stats)
        logger.info("load plan %s", report)
        # the prompt holds the request's chunks (the kept prefix is its own first tokens), no other
        chunk_keys = _chunk_keys(request)
        keep = None if chunk_keys is None else PromptToKeep(request.namespace, match.entry.kind, chunk_keys, kept.mode,
                                                            request.prefix_cache_epoch)
        yield PrefillOutcome(result, handles, report, keep)

    def _keeping(self, request: PrefillRequest, parts: Generator[PrefillOutcome | None, None, None]
                 ) -> Generator[PrefillOutcome | None, None, None]:
        """`parts`, the outcome told where its prompt goes in the prefix cache; closing this closes `parts`."""
        try:
            for part in parts:
                if part is not None and self._is_prefix_cached(request) and _chunk_keys(request) is not None:
                    part.keep = PromptToKeep(request.namespace, prefill_kind(request), _chunk_keys(request),
                                             part.result.stats.mode, request.prefix_cache_epoch)
                yield part
        finally:
            parts.close()

    def keep(self, outcome: PrefillOutcome) -> bool:
        """Keep the outcome's prompt in the prefix cache (its KV by reference: the request decodes past
        it, or over a copy), where its outcome says so; call once its first token is out. Whether kept."""
        spec = outcome.keep
        if spec is None or self.prefix_cache is None:
            return False
        result = outcome.result
        kept = KeptPrompt(PromptKV.of(result.cache, len(result.token_ids)), result.logits, spec.mode)
        return self.prefix_cache.insert(spec.namespace, spec.kind, result.token_ids, kept, kept.nbytes,
                                        spec.chunk_keys, spec.epoch)

    @property
    def max_step_token_layers(self) -> int:
        """A layer-cut prefill's budget per step: the token-layers of one full chunk."""
        return self.prefill_chunk_tokens * self.engine.num_layers

    def num_prompt_tokens(self, request: PrefillRequest) -> int:
        """The prompt's length, without model work (any thread)."""
        return sum(len(s.token_ids) for s in self._segments(request, with_kv=False))

    def _segments(self, request: PrefillRequest, with_kv: bool) -> list[Segment]:
        """The prompt's segments. Without KV (for counting, off the loop) no model work is done: the
        engine's own build_segments may compute a prompt prefix's KV, so only the loop calls it."""
        chunks = [Segment(c.token_ids, self._handle(c) if with_kv else None) for c in request.chunks]
        if not with_kv:
            return self.engine.prompts.segments(request.question, chunks, list(request.history))
        return self.engine.build_segments(request.question, chunks, list(request.history))

    def _handle(self, chunk: PromptChunk) -> StoredChunk | None:
        if chunk.kv_key is None:
            return None
        handle = self.kv_store.handle(chunk.kv_key)  # a damaged entry is deleted here: a miss
        if handle is None and self.repairer is not None:  # this question recomputes it; later ones reuse it
            self.repairer.schedule(chunk.kv_key, chunk.token_ids, self.engine.sink_ids(self.blend.sink))
        return handle

    def _prefill(self, request: PrefillRequest, segments: list[Segment], handles: list[StoredChunk],
                 mode: PrefillMode, plan: LoadPlan | None,
                 blend: BlendConfig) -> Generator[PrefillOutcome | None, None, None]:
        """The engine's prefill cut by layers (`max_step_token_layers` a step), then the outcome."""
        if plan is not None:
            segments = planned_segments(segments, plan)
        used = handles_in(segments)
        source = self._layer_source(used, mode, blend.first_check_layer) if used else None
        try:
            parts = self.engine.prefill_steps(
                segments, mode=mode, blend=blend, kv_source=source,
                max_new_tokens=request.sampling.max_tokens, max_step_token_layers=self.max_step_token_layers,
            )
            try:
                for part in parts:
                    if part is not None:
                        result = part
                        break
                    yield None  # the running sequences decode a step before the next part
            finally:
                parts.close()  # abandoned midway: the engine's own source is closed before the store's
        finally:
            if source is not None:
                source.close()  # its loader thread stops here, also when the request was abandoned
        self.kv_store.planner.observe(shape_of(result.stats, self.engine.num_layers, blend.first_check_layer),
                                      compute_seconds(result.stats))
        if plan is None:
            outcome = PrefillOutcome(result, handles, None)
        else:
            load_s = source.stats.load_seconds if source is not None else 0.0
            outcome = self._planned_outcome(result, handles, len(handles) - len(used), load_s, plan)
        outcome.num_opening_tokens = _opening_reused(segments, result.stats)
        yield outcome

    def _planned_outcome(self, result: PrefillResult, handles: list[StoredChunk], num_recomputed: int,
                         load_s: float, plan: LoadPlan) -> PrefillOutcome:
        report = PlanReport.of(plan, num_recomputed, load_s, result.stats)
        logger.info("load plan %s", report)
        # chunks computed fresh from slow tiers are promoted after the answer, like streamed ones
        return PrefillOutcome(result, handles, report)

    def _chunked_full(self, request: PrefillRequest, segments: list[Segment], handles: list[StoredChunk],
                      plan: LoadPlan | None, first_check_layer: int) -> Generator[PrefillOutcome | None, None, None]:
        """A full prefill, `prefill_chunk_tokens` per step: the first chunk prefilled, each next one fed
        after the cache's end (causal over everything before it: what one full prefill computes). A
        planner's full plan reads no stored KV (`planned_segments` makes every chunk fresh): its report
        and outcome are those of the whole prefill it replaces."""
        token_ids = [t for s in segments for t in s.token_ids]
        chunk, num_tokens, max_new_tokens = self.prefill_chunk_tokens, len(token_ids), request.sampling.max_tokens
        t_start, elapsed_s = time.perf_counter(), 0.0
        first = self.engine.prefill([Segment(tuple(token_ids[:chunk]))], mode=PrefillMode.FULL,
                                    max_new_tokens=num_tokens - chunk + max_new_tokens)
        logits = first.logits
        for start in range(chunk, num_tokens, chunk):
            elapsed_s += time.perf_counter() - t_start
            yield None  # the running sequences decode a step before the next chunk
            t_start = time.perf_counter()
            logits = self.engine.forward_tokens(first, token_ids[start:start + chunk], is_last_only=True)[0]  # [vocab]
        elapsed_s += time.perf_counter() - t_start
        stats = PrefillStats(PrefillMode.FULL, num_prompt_tokens=num_tokens, num_recomputed_tokens=num_tokens,
                             compute_ms=elapsed_s * 1000, prefill_ms=elapsed_s * 1000)
        result = PrefillResult(token_ids, first.cache, logits, stats)
        if plan is None:
            yield PrefillOutcome(result, [], None)
            return
        # as a whole planned prefill does: its time teaches the cost model, its chunks are promoted after
        self.kv_store.planner.observe(shape_of(stats, self.engine.num_layers, first_check_layer),
                                      compute_seconds(stats))
        yield self._planned_outcome(result, handles, len(handles), 0.0, plan)

    def _plan(self, request: PrefillRequest, segments: list[Segment], handles: list[StoredChunk],
              first_check_layer: int, num_prefix_cached: int = 0) -> tuple[PrefillMode, LoadPlan | None]:
        """The prefill mode to run, and the loading planner's plan where the request leaves it the choice
        or the prefix cache holds `num_prefix_cached` of its tokens (its plan, where predicted sooner than
        the one the request runs otherwise)."""
        mode, plan = self._chunk_plan(request, segments, handles, first_check_layer)
        if not num_prefix_cached:
            return mode, plan
        self._ensure_planner()
        plan_request = self._plan_request(segments, handles, first_check_layer, num_prefix_cached)
        otherwise = plan
        if otherwise is None:  # the request's own mode: its predicted cost
            alone = replace(plan_request, num_prefix_cached_tokens=0)
            otherwise = (self.kv_store.planner.full(alone) if mode is PrefillMode.FULL
                         else self.kv_store.plan(alone, is_blend_only=True))
        cached = self.kv_store.planner.with_prefix_cache(plan_request, otherwise)
        return (mode, cached) if cached.kind is PlanKind.PREFIX_CACHE else (mode, plan)

    def _plan_request(self, segments: list[Segment], handles: list[StoredChunk], first_check_layer: int,
                      num_prefix_cached: int = 0) -> PlanRequest:
        return PlanRequest(
            chunks=handles, num_prompt_tokens=sum(len(s.token_ids) for s in segments),
            num_fresh_tokens=sum(len(s.token_ids) for s in segments if not isinstance(s.kv, StoredChunk)),
            first_reused_layer=first_check_layer,
            num_layers=self.engine.num_layers,
            is_pipelined=self.kv_store.config.pipelined,
            num_prefix_cached_tokens=num_prefix_cached,
        )

    def _chunk_plan(self, request: PrefillRequest, segments: list[Segment], handles: list[StoredChunk],
                    first_check_layer: int) -> tuple[PrefillMode, LoadPlan | None]:
        """How to use the stored chunks: the request's mode, or the planner's choice where it has one."""
        is_auto = request.mode is RequestMode.AUTO
        if not handles:
            # Nothing stored to reuse (every chunk missed): a blend would run its selection over the
            # prompt prefix's KV alone, and every other token as a subset of queries; a full prefill
            # is the reference answer, and ~1.4x sooner (docs/benchmarks/corpus.md).
            return (PrefillMode.FULL if is_auto else PrefillMode(request.mode.value)), None
        if not (is_auto or request.recompute_ratio == "auto"):
            return PrefillMode(request.mode.value), None
        if is_auto or request.mode is RequestMode.BLEND:
            self._ensure_planner()
            plan_request = self._plan_request(segments, handles, first_check_layer)
            plan = self.kv_store.plan(plan_request, is_blend_only=not is_auto)
            return (PrefillMode.FULL if plan.kind is PlanKind.FULL else PrefillMode.BLEND), plan
        return PrefillMode(request.mode.value), None  # 'auto' ratio outside blend: nothing to choose

    def _layer_source(self, handles: list[StoredChunk], mode: PrefillMode, first_check_layer: int) -> StoreLayerSource:
        start_layer = first_check_layer if mode is PrefillMode.BLEND else 0
        return self.kv_store.layer_source(
            handles, self.engine.device, self.engine.dtype, start_layer=start_layer, recompute=self.engine.precompute,
        )

    def request_config(self, request: PrefillRequest) -> BlendConfig:
        """The blend config this request runs with, fitted to the engine: the configured one with the
        request's selection and ratio (None and 'auto': the configured ratio, the planner may set its own).
        A request's selection can move the check layer (a deviation ranking checks at layer 1 at least),
        so everything keyed to the check layer reads it from here."""
        config = self.blend if request.selection is None else replace(self.blend, selection=request.selection)
        config = config.fitted(self.engine.num_layers)
        ratio = request.recompute_ratio
        if ratio == "adaptive":
            return replace(config, is_ratio_adaptive=True)
        if ratio in (None, "auto"):
            return config
        return replace(config, recompute_ratio=float(ratio))

    def measure_engine(self) -> None:
        """Fit the planner's cost model on timed prefills; run on the loop at start-up."""
        blend = self.blend.fitted(self.engine.num_layers)
        for shape, seconds in measure_engine(self.engine, self.profile_tokens, blend):
            self.kv_store.planner.observe(shape, seconds)

    def _ensure_planner(self) -> None:
        if not self.kv_store.planner.is_ready:  # the start-up job did not run (e.g. it failed): measure now
            self.measure_engine()


def prefill_kind(request: PrefillRequest) -> str:
    """The prefill a request asks for, as asked (its mode, ratio and selection; defaults unresolved): the
    prefix cache's kind of its prompt, the only kind it reuses."""
    selection = None if request.selection is None else request.selection.value
    return f"{request.mode.value}/{request.recompute_ratio}/{selection}"


def _opening_reused(segments: Sequence[Segment], stats: PrefillStats) -> int:
    """Of the prompt's opening (`build_segments`' first segment, on the engine's own KV: a ChunkKV, where
    a stored chunk's is a store handle), the tokens whose KV the prefill used as it was: every one but
    those blend recomputed, unless the prefill used no KV (full)."""
    if stats.mode is PrefillMode.FULL or not segments or not isinstance(segments[0].kv, ChunkKV):
        return 0
    num_opening = len(segments[0].token_ids)
    return num_opening - sum(1 for position in stats.selected_positions if position < num_opening)


def _chunk_keys(request: PrefillRequest) -> frozenset[str] | None:
    """The stored chunks' keys the prompt holds; None where a chunk has none (a prompt that could not be
    invalidated when its document changes is not kept)."""
    keys = [c.kv_key for c in request.chunks]
    return None if any(k is None for k in keys) else frozenset(keys)
