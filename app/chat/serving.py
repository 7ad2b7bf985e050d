"""/v1/chat/completions: RAG on the last user message, OpenAI's response and chunk formats."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from app.chat.protocol import (
    AssistantMessage, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatUsage, Choice,
    ChunkChoice, DeltaMessage, PromptTokensDetails,
)
from app.auth.principal import Principal
from app.collections.scope import Scopes
from app.errors import InvalidRequestError, stream_error_body
from app.openai_compat import requested_collections
from app.query.serving import answer_fields, build_rag_request, finish_fields, response_warnings, sources_out
from app.rag.collect import IsDisconnected, collect
from app.rag.pipeline import RagPipeline
from app.rag.types import AnswerStream, DoneEvent, RagContext, RagRequest, TokenEvent
from app.sse import sse
from configs.settings import Settings


@dataclass(frozen=True)
class ChatCall:
    id: str
    created: int
    model: str
    request: RagRequest
    context: RagContext
    stream: AnswerStream
    include_usage: bool = False  # stream_options.include_usage: usage in a last chunk with empty choices


@dataclass
class ChatService:
    settings: Settings
    pipeline: RagPipeline
    model_id: str
    scopes: Scopes

    async def prepare(self, body: ChatCompletionRequest, principal: Principal) -> ChatCall:
        t_start = time.perf_counter()
        body.check_fields()
        requested = requested_collections(body.collections, body.model, self.model_id)
        if body.messages[-1].role != "user":
            raise InvalidRequestError("the last message must be the user's question")
        if body.max_tokens is None and body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        history = [{"role": m.prompt_role, "content": m.text} for m in body.messages[:-1]]
        collections = await self.scopes.searched(principal, requested)
        request = build_rag_request(self.settings, body.messages[-1].text, body, history=history,
                                    collections=[c.name for c in collections])
        context = await self.pipeline.retrieve(request)
        stream = self.pipeline.start(request, context, t_start)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return ChatCall(f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body.model or self.model_id, request,
                        context, stream, include_usage)

    async def complete(self, call: ChatCall, is_disconnected: IsDisconnected) -> ChatCompletionResponse:
        answer, done = await collect(call.stream, is_disconnected)
        fields = answer_fields(answer, call.context, done)
        return ChatCompletionResponse(
            id=call.id, created=call.created, model=call.model,
            choices=[Choice(message=AssistantMessage(content=answer), finish_reason=finish_reason(done))],
            usage=chat_usage(done), sources=sources_out(call.context.sources),
            warnings=response_warnings(call.context, fields["unsupported"]), **fields,
        )

    async def chunks(self, call: ChatCall) -> AsyncIterator[str]:
        """OpenAI's stream: a first chunk with the role and the sources, content chunks, a chunk with
        finish_reason, timings and the citations, then `data: [DONE]`. The usage is on the finish chunk, or,
        with stream_options.include_usage, in a last chunk of its own with empty `choices` (OpenAI's format)."""

        def chunk(delta: DeltaMessage, **extra) -> str:
            body = ChatCompletionChunk(id=call.id, created=call.created, model=call.model,
                                       choices=[ChunkChoice(delta=delta, finish_reason=extra.pop("finish", None))],
                                       **extra)
            return sse(body.model_dump_json(exclude_none=True))

        try:
            yield chunk(DeltaMessage(role="assistant", content=""), sources=sources_out(call.context.sources),
                        warnings=call.context.warnings)
            pieces: list[str] = []
            async for event in call.stream:
                if isinstance(event, TokenEvent):
                    pieces.append(event.text)
                    yield chunk(DeltaMessage(content=event.text))
                else:
                    yield chunk(DeltaMessage(), finish=finish_reason(event),
                                usage=None if call.include_usage else chat_usage(event),
                                **finish_fields("".join(pieces), call.context, event))
                    if call.include_usage:
                        usage = ChatCompletionChunk(id=call.id, created=call.created, model=call.model, choices=[],
                                                    usage=chat_usage(event))
                        yield sse(usage.model_dump_json(exclude_none=True))
            yield sse("[DONE]")
        except Exception as exc:  # the headers are out: report in-band, as OpenAI does
            yield sse(stream_error_body(exc))
        finally:
            call.stream.cancel()


def finish_reason(done: DoneEvent) -> str:
    return done.finish_reason.value if done.finish_reason else "stop"


def chat_usage(done: DoneEvent) -> ChatUsage:
    u = done.usage
    return ChatUsage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                     total_tokens=u.prompt_tokens + u.completion_tokens, reused_tokens=u.reused_tokens,
                     recomputed_tokens=u.recomputed_tokens, prefix_cached_tokens=u.prefix_cached_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=u.prefix_cached_tokens))

