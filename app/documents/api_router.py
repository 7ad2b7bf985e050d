"""/v1/documents: ingest, list, get, delete."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from app.deps import DocumentsDep, KVBudgetDep
from app.documents.protocol import (
    DOCUMENT_ID_PATTERN, DeleteResponse, DocumentDetail, DocumentList, IngestRequest, IngestResponse,
)
from app.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/documents", tags=["documents"], responses=ERROR_RESPONSES)

DocumentId = Annotated[str, Path(pattern=DOCUMENT_ID_PATTERN)]


@router.post("", status_code=status.HTTP_201_CREATED)
async def ingest_documents(body: IngestRequest, documents: DocumentsDep, kv_budget: KVBudgetDep) -> IngestResponse:
    if kv_budget is not None:
        await kv_budget.check_request(body)
    return await documents.ingest(body)


@router.get("")
async def list_documents(
    documents: DocumentsDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
) -> DocumentList:
    return await documents.list(limit, offset)


@router.get("/{document_id}")
async def get_document(document_id: DocumentId, documents: DocumentsDep) -> DocumentDetail:
    return await documents.get(document_id)


@router.delete("/{document_id}")
async def delete_document(document_id: DocumentId, documents: DocumentsDep) -> DeleteResponse:
    return await documents.delete(document_id)
