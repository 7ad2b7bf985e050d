"""/v1/completions (OpenAI's legacy completions, as LlamaIndex's OpenAILike calls them): RAG on the prompt."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.completions.protocol import CompletionRequest, CompletionResponse
from app.deps import CompletionsDep, PrincipalDep
from app.errors import ERROR_RESPONSES
from app.sse import SSE_HEADERS, SSE_MEDIA_TYPE

router = APIRouter(prefix="/v1", tags=["chat"], responses=ERROR_RESPONSES)


@router.post(
    "/completions",
    response_model=CompletionResponse,
    responses={200: {"content": {SSE_MEDIA_TYPE: {}}, "description": "JSON, or SSE chunks when stream=true"}},
)
async def completions(body: CompletionRequest, service: CompletionsDep, principal: PrincipalDep, http_request: Request):
    call = await service.prepare(body, principal)
    if body.stream:
        return StreamingResponse(service.chunks(call), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    return await service.complete(call, http_request.is_disconnected)
