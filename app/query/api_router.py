"""/v1/query: RAG question answering, JSON or Server-Sent Events."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from app.deps import PrincipalDep, QueryDep
from app.errors import ERROR_RESPONSES
from app.query.protocol import QueryRequest, QueryResponse
from app.sse import SSE_HEADERS, SSE_MEDIA_TYPE

router = APIRouter(prefix="/v1", tags=["query"], responses=ERROR_RESPONSES)


@router.post(
    "/query",
    response_model=QueryResponse,
    responses={200: {"content": {SSE_MEDIA_TYPE: {}}, "description": "JSON, or SSE when stream=true"}},
)
async def query(body: QueryRequest, service: QueryDep, principal: PrincipalDep, http_request: Request):
    _, context, stream, _ = await service.prepare(body, principal)
    if body.stream:
        return StreamingResponse(service.events(context, stream), media_type=SSE_MEDIA_TYPE, headers=SSE_HEADERS)
    return await service.answer(context, stream, http_request.is_disconnected)
