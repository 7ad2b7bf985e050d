"""The RAG pipeline: retrieve (or take the named chunks), fit the model's context, then prefill
with the chunks' stored KV and decode on the engine worker."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import anyio

from app.errors import InvalidRequestError, NotFoundError
from app.metrics import Metrics
from app.rag.repair import KVRepairer
from app.rag.planning import PlanReport, compute_seconds, measure_engine, planned_segments, shape_of
from app.rag.types import DoneEvent, RagContext, RagRequest, Source, Timings, TokenEvent, Usage
from app.worker import EngineWorker, Job, JobStream
from blend_engine.threads import pin_one_thread
from blend_engine.types import BlendConfig, PrefillMode, PrefillResult, Segment
from configs.settings import RequestMode, Settings
from kv_store.loader import StoredChunk
from kv_store.planner import LoadPlan, PlanKind, PlanRequest
from retrieval.retriever import Retriever, ScoredChunk

logger = logging.getLogger(__name__)


@dataclass
class RagPipeline:
    settings: Settings
    engine: Any  # blend_engine.engine.BlendEngine
    retriever: Retriever
    kv_store: Any  # kv_store.KVStore
    worker: EngineWorker
    metrics: Metrics
    repairer: KVRepairer | None = None  # recomputes, in the background, the entries found missing

    async def retrieve(self, request: RagRequest) -> RagContext:
        start = time.perf_counter()
        scored = await anyio.to_thread.run_sync(self._scored_chunks, request)
        sources = [_source(s) for s in scored]
        kept, dropped = await anyio.to_thread.run_sync(self._fit_context, request, sources)
        if request.mode is not RequestMode.FULL:  # start moving their KV up while the request queues
            await anyio.to_thread.run_sync(self.kv_store.prefetch, [s.kv_key for s in kept if s.kv_key])
        return RagContext(kept, dropped, (time.perf_counter() - start) * 1000)

    def _scored_chunks(self, request: RagRequest) -> list[ScoredChunk]:
        pin_one_thread()  # the query's embedding runs torch on this worker thread: one thread, no pool
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
        result, handles, plan = self._prefill(request, context)
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
        done = DoneEvent(usage, timings, finish, stats.mode, stats.recompute_ratio, stats.is_guarded, plan=plan)
        self._observe(done)
        emit(done)
        # chunks streamed from disk or Redis: copy them into memory for the next question
        self.kv_store.promote(handles)

    def _prefill(self, request: RagRequest, context: RagContext) -> tuple[PrefillResult, list, PlanReport | None]:
        """The prefill, the store handles its KV was streamed from, and the loading plan (if planned)."""
        segments = self._segments(request, context.sources, with_kv=request.mode is not RequestMode.FULL)
        handles = [s.kv for s in segments if isinstance(s.kv, StoredChunk)]
        mode, plan = self._plan(request, segments, handles)
        if plan is not None:
            segments = planned_segments(segments, plan)
        used = [s.kv for s in segments if isinstance(s.kv, StoredChunk)]
        source = self._layer_source(used, mode) if used else None
        try:
            result = self.engine.prefill(
                segments, mode=mode, blend=self._blend_config(request, plan), kv_source=source,
                max_new_tokens=request.sampling.max_tokens,
            )
        finally:
            if source is not None:
                source.close()
        self.kv_store.planner.observe(shape_of(result.stats, self.engine.num_layers, self._first_check_layer),
                                      compute_seconds(result.stats))
        if plan is None:
            return result, handles, None
        load_s = source.stats.load_seconds if source is not None else 0.0
        report = PlanReport.of(plan, len(handles) - len(used), load_s, result.stats)
        logger.info("load plan %s", report)
        # chunks computed fresh from slow tiers are promoted after the answer, like streamed ones
        return result, handles, report

    @property
    def _first_check_layer(self) -> int:
        """Blend's first check layer (a request may change the selection or ratio, never the checks)."""
        return self.settings.blend.check_layers[0]

    def _plan(self, request: RagRequest, segments: list[Segment], handles: list) -> tuple[PrefillMode, LoadPlan | None]:
        """The prefill mode to run, and the loading planner's plan where the request leaves it the choice."""
        is_auto = request.mode is RequestMode.AUTO
        if not handles or not (is_auto or request.recompute_ratio == "auto"):
            return (PrefillMode.BLEND if is_auto else PrefillMode(request.mode.value)), None
        if is_auto or request.mode is RequestMode.BLEND:
            self._ensure_planner()
            plan_request = PlanRequest(
                chunks=handles, num_prompt_tokens=sum(len(s.token_ids) for s in segments),
                num_fresh_tokens=sum(len(s.token_ids) for s in segments if not isinstance(s.kv, StoredChunk)),
                first_reused_layer=self._first_check_layer,
                num_layers=self.engine.num_layers,
                is_pipelined=self.kv_store.config.is_pipelined,
            )
            plan = self.kv_store.plan(plan_request, is_blend_only=not is_auto)
            return (PrefillMode.FULL if plan.kind is PlanKind.FULL else PrefillMode.BLEND), plan
        return PrefillMode(request.mode.value), None  # 'auto' ratio outside blend: nothing to choose

    def _layer_source(self, handles: list[StoredChunk], mode: PrefillMode):
        start_layer = self._first_check_layer if mode is PrefillMode.BLEND else 0
        return self.kv_store.layer_source(
            handles, self.engine.device, self.engine.dtype, start_layer=start_layer, recompute=self.engine.precompute,
        )

    def _blend_config(self, request: RagRequest, plan: LoadPlan | None) -> BlendConfig:
        config = BlendConfig.from_settings(self.settings.blend)
        if request.selection is not None:
            config = replace(config, selection=request.selection)
        config = config.fitted(self.engine.num_layers)  # e.g. a deviation selection checks at layer 1 at least
        ratio = request.recompute_ratio
        if ratio == "adaptive":
            return replace(config, adaptive_mass=self.settings.blend.adaptive_mass)
        if ratio in (None, "auto"):  # the configured ratio, or the planner's (what the loads hide)
            return config if plan is None or plan.ratio is None else replace(config, recompute_ratio=plan.ratio)
        return replace(config, recompute_ratio=float(ratio))

    def measure_engine(self) -> None:
        """Fit the planner's cost model on timed prefills; run on the worker at start-up."""
        blend = BlendConfig.from_settings(self.settings.blend).fitted(self.engine.num_layers)
        for shape, seconds in measure_engine(self.engine, self.settings.store.planner_profile_tokens, blend):
            self.kv_store.planner.observe(shape, seconds)

    def _ensure_planner(self) -> None:
        if not self.kv_store.planner.is_ready:  # the start-up job did not run (e.g. it failed): measure now
            self.measure_engine()

    def _observe(self, event: DoneEvent) -> None:
        if event.plan is not None:
            self.metrics.observe_plan(event.plan.plan, event.plan.predicted_ttft_ms, event.plan.actual_prefill_ms)
        self.metrics.observe_generation(
            event.mode.value, event.timings.ttft_ms / 1000, event.usage.reused_tokens,
            event.usage.recomputed_tokens, event.usage.completion_tokens,
        )


def _source(scored: ScoredChunk) -> Source:
    c = scored.chunk
    return Source(c.id, c.document_id, c.title, scored.score, c.text, c.token_ids, c.kv_key, c.pages)


def _lowest_ranked(sources: list[Source]) -> int:
    if any(s.score is None for s in sources):
        return len(sources) - 1  # named chunks: their order is their rank
    return min(range(len(sources)), key=lambda i: sources[i].score)
