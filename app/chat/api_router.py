"""/v1/chat/completions (OpenAI-compatible, with RAG and citations)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.chat.protocol import ChatCompletionRequest, ChatCompletionResponse
from app.deps import ChatDep, PrincipalDep
from app.errors import ERROR_RESPONSES
from app.sse import SSE_HEADERS, SSE_MEDIA_TYPE

router = APIRouter(prefix="/v1", tags=["chat"], responses=ERROR_RESPONSES)


@router.post(
    "/chat/completions",
    response_model=ChatCompletionResponse,
    responses={200: {"content": {SSE_MEDIA_TYPE: {}}, "description": "JSON, or SSE chunks when stream=true"}},
)
async def chat_completions(body: ChatCompletionRequest, service: ChatDep, principal: PrincipalDep,
                           http_request: Request):
    call = await service.prepare(body, principal)
    if body.stream:
        return StreamingResponse(service.chunks(call), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    return await service.complete(call, http_request.is_disconnected)
