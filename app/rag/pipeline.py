"""The RAG pipeline: retrieve (or take the named chunks), fit the model's context, then prefill
with the chunks' stored KV and decode on the engine worker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import anyio

from app.errors import InvalidRequestError, NotFoundError
from app.metrics import Metrics
from app.rag.repair import KVRepairer
from app.rag.types import DoneEvent, RagContext, RagRequest, Source, Timings, TokenEvent, Usage
from app.worker import EngineWorker, Job, JobStream
from blend_engine.kv import ChunkKV
from blend_engine.types import BlendConfig, PrefillMode, PrefillResult, Segment
from configs.settings import Settings
from kv_store import EngineProfile
from retrieval.retriever import Retriever, ScoredChunk


@dataclass
class RagPipeline:
    settings: Settings
    engine: Any  # blend_engine.engine.BlendEngine
    retriever: Retriever
    kv_store: Any  # kv_store.KVStore
    worker: EngineWorker
    metrics: Metrics
    repairer: KVRepairer | None = None  # recomputes, in the background, the entries found missing
    _engine_profile: EngineProfile | None = field(default=None, init=False)

    async def retrieve(self, request: RagRequest) -> RagContext:
        start = time.perf_counter()
        scored = await anyio.to_thread.run_sync(self._scored_chunks, request)
        sources = [_source(s) for s in scored]
        kept, dropped = await anyio.to_thread.run_sync(self._fit_context, request, sources)
        return RagContext(kept, dropped, (time.perf_counter() - start) * 1000)

    def _scored_chunks(self, request: RagRequest) -> list[ScoredChunk]:
        if request.chunk_ids is None:
            return self.retriever.search(request.question, request.top_k)
        found, missing = self.retriever.named(request.chunk_ids)
        if missing:
            raise NotFoundError(f"unknown chunk id(s): {', '.join(missing[:10])}")
        return found

    def _fit_context(self, request: RagRequest, sources: list[Source]) -> tuple[list[Source], list[str]]:
        """Drop the lowest-scored chunks (the last named ones) until prompt + answer fit the context."""
        kept, dropped = list(sources), []
        budget = self.engine.max_context - request.sampling.max_tokens
        while True:
            num_tokens = sum(len(s.token_ids) for s in self._segments(request, kept, with_kv=False))
            if num_tokens <= budget:
                return kept, dropped
            if not kept:
                raise InvalidRequestError(self._too_long_message(request, num_tokens))
            worst = _lowest_ranked(kept)
            dropped.append(kept.pop(worst).chunk_id)

    def _too_long_message(self, request: RagRequest, num_tokens: int) -> str:
        """Why a prompt with no chunk left is still too long: the question, or the chat history."""
        what = "the question alone"
        if request.history:
            alone = replace(request, history=())
            num_question_tokens = sum(len(s.token_ids) for s in self._segments(alone, [], with_kv=False))
            what = (f"the chat history ({len(request.history)} messages, {num_tokens - num_question_tokens} "
                    f"tokens) with the question")
        return (f"{what} needs {num_tokens} prompt tokens; with max_tokens={request.sampling.max_tokens} that "
                f"exceeds the model's context of {self.engine.max_context}"
                + ("; shorten the history" if request.history else ""))

    def _segments(self, request: RagRequest, sources: Sequence[Source], with_kv: bool) -> list[Segment]:
        """The prompt's segments. Without KV (for counting, off the worker) no model work is done:
        the engine's own build_segments may compute a prompt prefix's KV, so only the worker calls it."""
        chunks = [Segment(s.token_ids, self._handle(s) if with_kv else None) for s in sources]
        if not with_kv:
            return self.engine.prompts.segments(request.question, chunks, list(request.history))
        return self.engine.build_segments(request.question, chunks, list(request.history))

    def _handle(self, source: Source) -> Any:
        if source.kv_key is None:
            return None
        handle = self.kv_store.handle(source.kv_key)  # a damaged entry is deleted here: a miss
        if handle is None and self.repairer is not None:  # this question recomputes it; later ones reuse it
            self.repairer.schedule(source.kv_key, source.token_ids, self.engine.sink_ids(self.settings.blend.sink))
        return handle

    def start(self, request: RagRequest, context: RagContext, t_start: float) -> JobStream:
        """Queue the generation (QueueFullError when full): TokenEvents, then one DoneEvent."""
        return self.worker.stream(lambda job, emit: self._run_generation(job, emit, request, context, t_start))

    def _run_generation(self, job: Job, emit, request: RagRequest, context: RagContext, t_start: float) -> None:
        job.check()
        result, handles = self._prefill(request, context)
        stats, usage = result.stats, Usage(
            prompt_tokens=result.stats.num_prompt_tokens,
            reused_tokens=result.stats.num_reused_tokens,
            recomputed_tokens=result.stats.num_recomputed_tokens,
        )
        timings = Timings(retrieval_ms=context.retrieval_ms, kv_load_ms=stats.kv_load_ms, prefill_ms=stats.prefill_ms)
        finish = None
        for delta in self.engine.generate(result, request.sampling):
            job.check()
            if usage.completion_tokens == 0 and delta.num_tokens > 0:
                timings.ttft_ms = (time.perf_counter() - t_start) * 1000
            usage.completion_tokens = delta.num_tokens
            if delta.text:
                emit(TokenEvent(delta.text))
            finish = delta.finish_reason or finish
        timings.total_ms = (time.perf_counter() - t_start) * 1000
        done = DoneEvent(usage, timings, finish, request.mode, stats.recompute_ratio, stats.is_guarded)
        self._observe(done)
        emit(done)
        # chunks streamed from disk or Redis: copy them into memory for the next question
        self.kv_store.promote(handles)

    def _prefill(self, request: RagRequest, context: RagContext) -> tuple[PrefillResult, list]:
        """The prefill, and the store handles its KV was streamed from."""
        is_reusing = request.mode is not PrefillMode.FULL
        segments = self._segments(request, context.sources, with_kv=is_reusing)
        handles = [s.kv for s in segments if s.kv is not None and not isinstance(s.kv, ChunkKV)]  # store handles
        source = None
        if handles:
            start_layer = self.settings.blend.check_layers[0] if request.mode is PrefillMode.BLEND else 0
            source = self.kv_store.layer_source(
                handles, self.engine.device, self.engine.dtype, start_layer=start_layer,
                recompute=self.engine.precompute,
            )
        try:
            result = self.engine.prefill(
                segments, mode=request.mode, blend=self._blend_config(request, handles),
                kv_source=source, max_new_tokens=request.sampling.max_tokens,
            )
            return result, handles
        finally:
            if source is not None:
                source.close()

    def _blend_config(self, request: RagRequest, handles: list) -> BlendConfig:
        config = BlendConfig.from_settings(self.settings.blend)
        if request.selection is not None:
            config = replace(config, selection=request.selection)
        ratio = request.recompute_ratio
        if ratio == "adaptive":
            return replace(config, adaptive_mass=self.settings.blend.adaptive_mass)
        if ratio == "auto":
            ratio = self.kv_store.choose_ratio(handles, self._profile()) if handles else config.recompute_ratio
        if ratio is None:
            return config
        return replace(config, recompute_ratio=float(ratio))

    def _profile(self) -> EngineProfile:
        """The engine's recompute speed for ratio='auto', measured once (on the worker)."""
        if self._engine_profile is None:
            self._engine_profile = EngineProfile.measure(self.engine)
        return self._engine_profile

    def _observe(self, event: DoneEvent) -> None:
        self.metrics.observe_generation(
            event.mode.value, event.timings.ttft_ms / 1000, event.usage.reused_tokens,
            event.usage.recomputed_tokens, event.usage.completion_tokens,
        )


def _source(scored: ScoredChunk) -> Source:
    c = scored.chunk
    return Source(c.id, c.document_id, c.title, scored.score, c.text, c.token_ids, c.kv_key)


def _lowest_ranked(sources: list[Source]) -> int:
    if any(s.score is None for s in sources):
        return len(sources) - 1  # named chunks: their order is their rank
    return min(range(len(sources)), key=lambda i: sources[i].score)
