"""/v1/documents: ingest, list, get, delete; each in the request's collection(s)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, status

from app.auth.principal import Role
from app.deps import DocumentsDep, KVBudgetDep, PrincipalDep, ScopesDep
from app.documents.protocol import (
    DOCUMENT_ID_PATTERN, DeleteResponse, DocumentDetail, DocumentList, IngestRequest, IngestResponse,
)
from app.errors import ERROR_RESPONSES
from retrieval.store_types import COLLECTION_NAME_PATTERN

router = APIRouter(prefix="/v1/documents", tags=["documents"], responses=ERROR_RESPONSES)

DocumentId = Annotated[str, Path(pattern=DOCUMENT_ID_PATTERN)]
CollectionsQuery = Annotated[list[Annotated[str, Query(pattern=COLLECTION_NAME_PATTERN)]] | None, Query(
    description="The collection(s), repeatable; default: `default` (a scoped key: its own).")]
CollectionQuery = Annotated[str | None, Query(
    pattern=COLLECTION_NAME_PATTERN, description="The document's collection; default: the one of the caller's "
    "collections holding it.")]


@router.post("", status_code=status.HTTP_201_CREATED)
async def ingest_documents(body: IngestRequest, documents: DocumentsDep, kv_budget: KVBudgetDep,
                           scopes: ScopesDep, principal: PrincipalDep) -> IngestResponse:
    collection = await scopes.one(principal, body.collection, Role.WRITE)
    if kv_budget is not None:
        await kv_budget.check_request(body)
    return await documents.ingest(body, collection)


@router.get("")
async def list_documents(
    documents: DocumentsDep, scopes: ScopesDep, principal: PrincipalDep,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, le=2**31)] = 0,
    collection: CollectionsQuery = None,
) -> DocumentList:
    return await documents.list(limit, offset, await scopes.readable(principal, collection))


@router.get("/{document_id}")
async def get_document(document_id: DocumentId, documents: DocumentsDep, scopes: ScopesDep,
                       principal: PrincipalDep, collection: CollectionQuery = None) -> DocumentDetail:
    rows = await scopes.readable(principal, [collection] if collection else None)
    return await documents.get(document_id, await documents.find(document_id, [r.name for r in rows]))


@router.delete("/{document_id}")
async def delete_document(document_id: DocumentId, documents: DocumentsDep, scopes: ScopesDep,
                          principal: PrincipalDep, collection: CollectionQuery = None) -> DeleteResponse:
    rows = await scopes.readable(principal, [collection] if collection else None)
    name = await documents.find(document_id, [r.name for r in rows])
    await scopes.one(principal, name, Role.WRITE)  # a read key sees the document, may not delete it: 403
    return await documents.delete(document_id, name)
