"""/v1/query: validate, retrieve, answer (JSON or Server-Sent Events)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import AsyncIterator, Sequence, TypedDict, TypeVar

from app.auth.principal import Principal
from app.collections.scope import Scopes
from app.errors import InvalidRequestError, stream_error_body
from app.query.protocol import (
    CitationOut, GenerationOptions, PlanOut, QueryRequest, QueryResponse, SourceOut, TimingsOut, UsageOut,
)
from app.rag.citations import citations
from app.rag.collect import IsDisconnected, collect
from app.rag.grounding import unsupported_in, unsupported_warnings
from app.rag.pipeline import RagPipeline
from app.rag.types import AnswerStream, DoneEvent, RagContext, RagRequest, Source, TokenEvent
from app.sse import sse
from app.text import is_blank
from blend_engine.types import SamplingParams
from app.config import LimitsConfig
from configs.settings import Settings
from retrieval.store_types import DEFAULT_COLLECTION

T = TypeVar("T")


def build_rag_request(
    settings: Settings, question: str, options: GenerationOptions, history: Sequence[dict] = (),
    collections: Sequence[str] = (DEFAULT_COLLECTION,),
) -> RagRequest:
    """A RagRequest with defaults from config; raises InvalidRequestError for limits a user can break."""
    limits, gen = settings.limits, settings.generation
    if is_blank(question):
        raise InvalidRequestError("the question is empty")
    if len(question) > limits.max_question_chars:
        raise InvalidRequestError(f"the question has {len(question)} characters; the limit is {limits.max_question_chars}")
    _check_history(history, limits)
    top_k = options.top_k or settings.retrieval.top_k
    if top_k > limits.max_top_k:
        raise InvalidRequestError(f"top_k={top_k} exceeds the limit of {limits.max_top_k}")
    if options.chunk_ids is not None and len(options.chunk_ids) > limits.max_chunk_ids:
        raise InvalidRequestError(f"{len(options.chunk_ids)} chunk_ids; the limit is {limits.max_chunk_ids}")
    max_tokens = options.max_tokens or gen.max_tokens
    if max_tokens > limits.max_tokens:
        raise InvalidRequestError(f"max_tokens={max_tokens} exceeds the limit of {limits.max_tokens}")
    ratio = options.recompute_ratio
    if isinstance(ratio, float) and not 0.0 <= ratio <= 1.0:
        raise InvalidRequestError(f"recompute_ratio must be in [0, 1], 'auto' or 'adaptive', got {ratio}")
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=gen.temperature if options.temperature is None else options.temperature,
        top_p=gen.top_p if options.top_p is None else options.top_p,
        seed=options.seed,
        # ignore_eos promises max_tokens tokens: the configured stop strings do not apply (a request's own do)
        stop=_given(options.stop_strings, () if options.ignore_eos else gen.stop),
        is_eos_ignored=options.ignore_eos,
        repetition_penalty=_given(options.repetition_penalty, gen.repetition_penalty),
        repetition_scope=_given(options.repetition_scope, gen.repetition_scope),
        frequency_penalty=_given(options.frequency_penalty, gen.frequency_penalty),
        presence_penalty=_given(options.presence_penalty, gen.presence_penalty),
        no_repeat_ngram_size=_given(options.no_repeat_ngram_size, gen.no_repeat_ngram_size),
    )
    return RagRequest(
        question=question, mode=options.mode or settings.blend.mode, sampling=sampling, top_k=top_k,
        retrieval=options.retrieval or settings.retrieval.mode,
        chunk_ids=tuple(options.chunk_ids) if options.chunk_ids is not None else None,
        recompute_ratio=ratio, selection=options.selection, history=tuple(history), collections=tuple(collections),
        is_prefix_cache_used=options.prefix_cache,
    )


def _given(value: T | None, default: T) -> T:
    """A request's value, or the configured default where it leaves it out."""
    return default if value is None else value


def _check_history(history: Sequence[dict], limits: LimitsConfig) -> None:
    """Sizes first: a history past these is refused before its tokens are counted (tokenizing megabytes
    of history, once per chunk the context fit drops, cost half a minute of CPU for the same 422)."""
    if len(history) > limits.max_history_messages:
        raise InvalidRequestError(f"{len(history)} earlier messages; the limit is {limits.max_history_messages} "
                                  "(limits.max_history_messages): shorten the history")
    num_chars = sum(len(message["content"]) for message in history)
    if num_chars > limits.max_history_chars:
        raise InvalidRequestError(f"the earlier messages have {num_chars} characters; the limit is "
                                  f"{limits.max_history_chars} (limits.max_history_chars): shorten the history")


def plan_out(done: DoneEvent) -> PlanOut | None:
    return None if done.plan is None else PlanOut(**asdict(done.plan))


class AnswerFields(TypedDict):
    """How an answer was made, as the OpenAI-shaped responses report it (chat and completions, in the
    response and in the stream's chunk with finish_reason): one builder, so the two cannot drift apart."""

    citations: list[CitationOut]
    timings: TimingsOut
    mode: str | None
    recompute_ratio: float | None
    quality_guarded: bool
    plan: PlanOut | None
    unsupported: list[str]


def answer_fields(answer: str, context: RagContext, done: DoneEvent) -> AnswerFields:
    """The fields of `AnswerFields` for `answer` (the whole text: its [n] are mapped to the context's
    sources, its numbers and names checked against them: app/rag/grounding.py)."""
    return AnswerFields(citations=citations_out(answer, context.sources), timings=TimingsOut(**asdict(done.timings)),
                        mode=done.mode.value if done.mode else None, recompute_ratio=done.recompute_ratio,
                        quality_guarded=done.is_guarded, plan=plan_out(done),
                        unsupported=unsupported_in(context, answer))


def finish_fields(answer: str, context: RagContext, done: DoneEvent) -> dict:
    """An OpenAI-shaped stream's finish chunk (chat and completions): `answer_fields` with the answer's own
    warnings (retrieval's went out on the first chunk); None when it has none (the chunk leaves it out)."""
    fields = answer_fields(answer, context, done)
    return {**fields, "warnings": unsupported_warnings(fields["unsupported"]) or None}


def response_warnings(context: RagContext, unsupported: list[str]) -> list[str]:
    """A whole response's warnings: retrieval's, then the answer's own (its unsupported terms)."""
    return context.warnings + unsupported_warnings(unsupported)


def citations_out(answer: str, sources: Sequence[Source]) -> list[CitationOut]:
    """The sources `answer` cites as [n] (app/rag/citations.py), as the API returns them."""
    return [CitationOut(number=c.number, chunk_id=c.source.chunk_id, document_id=c.source.document_id,
                        title=c.source.title, pages=list(c.source.pages) if c.source.pages else None)
            for c in citations(answer, sources)]


def sources_out(sources: Sequence[Source]) -> list[SourceOut]:
    return [SourceOut(chunk_id=s.chunk_id, document_id=s.document_id, collection=s.collection, title=s.title,
                      score=s.score, text=s.text, pages=list(s.pages) if s.pages else None)
            for s in sources]


@dataclass
class QueryService:
    settings: Settings
    pipeline: RagPipeline
    scopes: Scopes

    async def prepare(self, body: QueryRequest,
                      principal: Principal) -> tuple[RagRequest, RagContext, AnswerStream, float]:
        """Everything that can fail with a 4xx/503 happens here, before a stream's headers go out."""
        t_start = time.perf_counter()
        collections = await self.scopes.searched(principal, body.collections)
        request = build_rag_request(self.settings, body.question, body, collections=[c.name for c in collections])
        context = await self.pipeline.retrieve(request)
        return request, context, self.pipeline.start(request, context, t_start), t_start

    async def answer(self, context: RagContext, stream: AnswerStream,
                     is_disconnected: IsDisconnected) -> QueryResponse:
        answer, done = await collect(stream, is_disconnected)
        return _response(answer, context, done)

    async def events(self, context: RagContext, stream: AnswerStream) -> AsyncIterator[str]:
        """SSE: `sources` (with the question's unmatched words and the retrieval's warnings), then `token`
        events, then `done` (usage, timings, citations, the answer's unsupported terms and their warning) or
        `error`."""
        try:
            yield sse({"sources": [s.model_dump() for s in sources_out(context.sources)],
                       "unmatched_words": list(context.unmatched_words), "warnings": context.warnings}, event="sources")
            pieces: list[str] = []
            async for event in stream:
                if isinstance(event, TokenEvent):
                    pieces.append(event.text)
                    yield sse({"text": event.text}, event="token")
                else:
                    answer = "".join(pieces)
                    cited = citations_out(answer, context.sources)
                    unsupported = unsupported_in(context, answer)
                    yield sse({**_done_payload(event), "citations": [c.model_dump() for c in cited],
                               "unsupported": unsupported, "warnings": unsupported_warnings(unsupported)}, event="done")
        except Exception as exc:  # the headers are out: report in-band
            yield sse(stream_error_body(exc), event="error")
        finally:
            stream.cancel()


def _done_payload(done: DoneEvent) -> dict:
    return {"mode": done.mode.value if done.mode else None, "finish_reason": done.finish_reason.value if done.finish_reason else None,
            "recompute_ratio": done.recompute_ratio, "quality_guarded": done.is_guarded,
            "plan": asdict(done.plan) if done.plan else None,
            "usage": asdict(done.usage), "timings": asdict(done.timings)}


def _response(answer: str, context: RagContext, done: DoneEvent) -> QueryResponse:
    unsupported = unsupported_in(context, answer)
    return QueryResponse(
        answer=answer, mode=done.mode, finish_reason=done.finish_reason.value if done.finish_reason else None,
        recompute_ratio=done.recompute_ratio, quality_guarded=done.is_guarded, plan=plan_out(done),
        sources=sources_out(context.sources), citations=citations_out(answer, context.sources),
        usage=UsageOut(**asdict(done.usage)), timings=TimingsOut(**asdict(done.timings)),
        unsupported=unsupported, unmatched_words=list(context.unmatched_words),
        warnings=response_warnings(context, unsupported),
    )
