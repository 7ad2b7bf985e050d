"""/v1/completions: RAG on the prompt, OpenAI's text_completion response and stream."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from app.auth.principal import Principal
from app.chat.serving import ChatCall, chat_usage, finish_reason
from app.collections.scope import Scopes
from app.completions.protocol import CompletionChoice, CompletionRequest, CompletionResponse
from app.errors import InvalidRequestError, stream_error_body
from app.openai_compat import requested_collections
from app.query.serving import answer_fields, build_rag_request, finish_fields, response_warnings, sources_out
from app.rag.collect import IsDisconnected, collect
from app.rag.pipeline import RagPipeline
from app.rag.types import TokenEvent
from app.sse import sse
from configs.settings import Settings


@dataclass
class CompletionService:
    settings: Settings
    pipeline: RagPipeline
    model_id: str
    scopes: Scopes

    async def prepare(self, body: CompletionRequest, principal: Principal) -> ChatCall:
        t_start = time.perf_counter()
        body.check_fields()
        if isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise InvalidRequestError(f"prompt holds {len(body.prompt)} prompts; send one (a string, or a list of one)")
        requested = requested_collections(body.collections, body.model, self.model_id)
        collections = await self.scopes.searched(principal, requested)
        request = build_rag_request(self.settings, body.question, body, collections=[c.name for c in collections])
        context = await self.pipeline.retrieve(request)
        stream = self.pipeline.start(request, context, t_start)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return ChatCall(f"cmpl-{uuid.uuid4().hex}", int(time.time()), body.model or self.model_id, request, context,
                        stream, include_usage)

    async def complete(self, call: ChatCall, is_disconnected: IsDisconnected) -> CompletionResponse:
        answer, done = await collect(call.stream, is_disconnected)
        fields = answer_fields(answer, call.context, done)
        return CompletionResponse(
            id=call.id, created=call.created, model=call.model,
            choices=[CompletionChoice(text=answer, finish_reason=finish_reason(done))], usage=chat_usage(done),
            sources=sources_out(call.context.sources),
            warnings=response_warnings(call.context, fields["unsupported"]), **fields,
        )

    async def chunks(self, call: ChatCall) -> AsyncIterator[str]:
        """OpenAI's completion stream: text chunks (the first carries the sources), a chunk with
        finish_reason, timings and the citations, then `data: [DONE]`; the usage as in chat completions
        (finish chunk, or a last chunk with empty `choices` under stream_options.include_usage)."""

        def chunk(text: str, finish: str | None = None, **extra) -> str:
            body = CompletionResponse(id=call.id, created=call.created, model=call.model,
                                      choices=[CompletionChoice(text=text, finish_reason=finish)], **extra)
            return sse(body.model_dump_json(exclude_none=True))

        try:
            yield chunk("", sources=sources_out(call.context.sources), warnings=call.context.warnings)
            pieces: list[str] = []
            async for event in call.stream:
                if isinstance(event, TokenEvent):
                    pieces.append(event.text)
                    yield chunk(event.text)
                else:
                    yield chunk("", finish_reason(event), usage=None if call.include_usage else chat_usage(event),
                                **finish_fields("".join(pieces), call.context, event))
                    if call.include_usage:
                        usage = CompletionResponse(id=call.id, created=call.created, model=call.model, choices=[],
                                                   usage=chat_usage(event))
                        yield sse(usage.model_dump_json(exclude_none=True))
            yield sse("[DONE]")
        except Exception as exc:  # the headers are out: report in-band, as OpenAI does
            yield sse(stream_error_body(exc))
        finally:
            call.stream.cancel()

