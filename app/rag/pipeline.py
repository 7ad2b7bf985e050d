"""The RAG pipeline: retrieve (or take the named chunks), fit the model's context, then hand the
prompt to the engine loop (runtime/), which prefills it with the chunks' stored KV and decodes it in
the batch."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import anyio

from app.errors import InvalidRequestError, NotFoundError
from app.rag.types import AnswerStream, FixedAnswer, RagContext, RagRequest, Source
from blend_engine.engine import BlendEngine
from blend_engine.threads import pin_one_thread
from blend_engine.types import Segment
from configs.enums import RequestMode
from configs.settings import Settings
from kv_store import KVStore
from retrieval.config import RetrievalConfig
from retrieval.retriever import RelevanceFloor, Retriever, ScoredChunk
from runtime.loop import EngineLoop
from runtime.types import PrefillRequest, PromptChunk


@dataclass(frozen=True)
class Retrieved:
    """What retrieval found for a request: the chunks, or none and why."""

    chunks: list[ScoredChunk]
    is_nothing_relevant: bool = False  # no chunk passed the relevance floor, or a name is unmentioned
    unmentioned_names: tuple[str, ...] = ()  # what the question names that no searched chunk mentions
    unmatched_words: tuple[str, ...] = ()  # the question's words no searched chunk holds (answered all the same)


def relevant_chunks(retriever: Retriever, config: RetrievalConfig, request: RagRequest) -> Retrieved:
    """The request's question searched as the server does: ranked, checked for names no document mentions,
    then cut by the relevance floor (also the context-bound bench's retrieval)."""
    checked = retriever.checked_search(request.question, request.top_k, request.collections, request.retrieval,
                                       config.num_candidates, config.rrf_k, names=config.refuse_unmentioned_names,
                                       words=config.flag_unmatched_words)
    if checked.words.unmentioned_names:  # about something no document names: not found, whatever ranked
        return Retrieved([], is_nothing_relevant=True, unmentioned_names=checked.words.unmentioned_names)
    relevant = RelevanceFloor(config.min_score, config.score_margin).apply(checked.scored)
    # with min_score off (-1) nothing is refused: a store with no chunks is answered as before
    return Retrieved(relevant, is_nothing_relevant=not relevant and config.min_score > -1.0,
                     unmatched_words=checked.words.unmatched_words if relevant else ())


@dataclass
class RagPipeline:
    settings: Settings
    engine: BlendEngine
    retriever: Retriever
    kv_store: KVStore
    loop: EngineLoop

    async def retrieve(self, request: RagRequest) -> RagContext:
        """The request's context, prepared on one worker thread: the steps run one after another anyway,
        and three fewer hops to a thread and back took ~0.6 ms off the server's retrieval (stop 59)."""
        return await anyio.to_thread.run_sync(self._context, request, time.perf_counter())

    def _context(self, request: RagRequest, start: float) -> RagContext:
        """Retrieve, fit the context, start the KV's prefetch and read the namespace (a worker thread)."""
        epoch = self.kv_store.prompts.epoch  # before the chunks are read: a change from now on is seen
        found = self._retrieved(request)
        kept, dropped, num_tokens = self._fit_context(request, self._within_budget([_source(s) for s in found.chunks]))
        if request.mode is not RequestMode.FULL:  # start moving their KV up while the request queues
            self.kv_store.prefetch([s.kv_key for s in kept if s.kv_key])
        namespace = self._namespace(request)
        asked = (request.question, *(message["content"] for message in request.history))
        return RagContext(kept, dropped, (time.perf_counter() - start) * 1000, num_tokens, epoch, namespace,
                          found.is_nothing_relevant, found.unmentioned_names, asked,
                          self.settings.retrieval.flag_unsupported_terms, found.unmatched_words)

    def _namespace(self, request: RagRequest) -> str:
        """The request's collections' KV salts: its prompt is kept for, and served to, that set alone
        (collections sharing KV have one salt, so they share kept prompts too)."""
        rows = (self.retriever.store.get_collection(name) for name in request.collections)
        return "|".join(sorted({row.kv_salt for row in rows if row is not None}))

    def _retrieved(self, request: RagRequest) -> Retrieved:
        """The chunks for the prompt, or none and why (the answer is then the fixed not-found answer)."""
        pin_one_thread()  # the query's embedding runs torch on this worker thread: one thread, no pool
        if request.chunk_ids is None:
            return relevant_chunks(self.retriever, self.settings.retrieval, request)
        # named chunks are never refused: the caller chose them
        found, missing = self.retriever.named(request.chunk_ids, request.collections)
        if missing:
            raise NotFoundError(f"unknown chunk id(s): {', '.join(missing[:10])}")
        return Retrieved(found)

    def _within_budget(self, sources: list[Source]) -> list[Source]:
        """The best-ranked sources whose tokens fit retrieval.context_tokens (the first always)."""
        budget = self.settings.retrieval.context_tokens
        if budget <= 0:
            return sources
        kept, num_tokens = [], 0
        for source in sources:
            num_tokens += len(source.token_ids)
            if kept and num_tokens > budget:
                break
            kept.append(source)
        return kept

    def _fit_context(self, request: RagRequest, sources: list[Source]) -> tuple[list[Source], list[str], int]:
        """Drop the lowest-ranked chunks (the last ones) until prompt + answer fit the context; the
        chunks kept, those dropped, and the prompt's length."""
        kept, dropped = list(sources), []
        budget = self.engine.max_context - request.sampling.max_tokens
        while True:
            num_tokens = sum(len(s.token_ids) for s in self._segments(request, kept))
            if num_tokens <= budget:
                return kept, dropped, num_tokens
            if not kept:
                raise InvalidRequestError(self._too_long_message(request, num_tokens))
            dropped.append(kept.pop().chunk_id)  # sources are in rank order (named ones: as named)

    def _too_long_message(self, request: RagRequest, num_tokens: int) -> str:
        """Why a prompt with no chunk left is still too long: the question, or the chat history."""
        what = "the question alone"
        if request.history:
            alone = replace(request, history=())
            num_question_tokens = sum(len(s.token_ids) for s in self._segments(alone, []))
            what = (f"the chat history ({len(request.history)} messages, {num_tokens - num_question_tokens} "
                    f"tokens) with the question")
        return (f"{what} needs {num_tokens} prompt tokens; with max_tokens={request.sampling.max_tokens} that "
                f"exceeds the model's context of {self.engine.max_context}"
                + ("; shorten the history" if request.history else ""))

    def _segments(self, request: RagRequest, sources: Sequence[Source]) -> list[Segment]:
        """The prompt's segments, for counting: no model work (this runs off the engine loop)."""
        chunks = [Segment(s.token_ids) for s in sources]
        return self.engine.prompts.segments(request.question, chunks, list(request.history))

    def start(self, request: RagRequest, context: RagContext, t_start: float) -> AnswerStream:
        """Queue the generation on the engine loop (QueueFull when full): TokenEvents, then one DoneEvent.
        Nothing relevant retrieved: the fixed not-found answer, without the model."""
        if context.is_nothing_relevant:
            return FixedAnswer(self.settings.retrieval.not_found_answer, context.retrieval_ms, t_start)
        return self.loop.generate(prefill_request(request, context.sources, context.prefix_cache_epoch,
                                                  context.namespace), t_start,
                                  context.retrieval_ms,
                                  context.num_prompt_tokens or None)


def prefill_request(request: RagRequest, sources: Sequence[Source],
                    prefix_cache_epoch: int | None = None, namespace: str = "") -> PrefillRequest:
    """What the engine prefills for `request` over `sources` (chosen at the prefix cache's epoch given;
    `namespace`: the prefix cache's, see RagContext)."""
    return PrefillRequest(
        question=request.question, chunks=tuple(PromptChunk(s.token_ids, s.kv_key) for s in sources),
        mode=request.mode, sampling=request.sampling, recompute_ratio=request.recompute_ratio,
        selection=request.selection, history=request.history, is_prefix_cache_used=request.is_prefix_cache_used,
        prefix_cache_epoch=prefix_cache_epoch, namespace=namespace,
    )


def _source(scored: ScoredChunk) -> Source:
    c = scored.chunk
    return Source(c.id, c.document_id, c.title, scored.score, c.text, c.token_ids, c.kv_key, c.pages, c.collection)

