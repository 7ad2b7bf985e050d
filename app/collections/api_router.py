"""/v1/collections: knowledge bases (create, list, read, change, delete)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, status

from app.collections.protocol import CollectionCreate, CollectionDeleted, CollectionList, CollectionOut, CollectionUpdate
from app.deps import CollectionsDep, PrincipalDep, require_server_key
from app.errors import ERROR_RESPONSES
from retrieval.store_types import COLLECTION_NAME_PATTERN

router = APIRouter(prefix="/v1/collections", tags=["collections"], responses=ERROR_RESPONSES)

CollectionName = Annotated[str, Path(pattern=COLLECTION_NAME_PATTERN)]


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Depends(require_server_key)])
async def create_collection(body: CollectionCreate, collections: CollectionsDep, principal: PrincipalDep) -> CollectionOut:
    return await collections.create(body, principal)


@router.get("")
async def list_collections(collections: CollectionsDep, principal: PrincipalDep) -> CollectionList:
    return await collections.list(principal)


@router.get("/{name}")
async def get_collection(name: CollectionName, collections: CollectionsDep, principal: PrincipalDep) -> CollectionOut:
    return await collections.get(name, principal)


@router.patch("/{name}")
async def update_collection(name: CollectionName, body: CollectionUpdate, collections: CollectionsDep,
                            principal: PrincipalDep) -> CollectionOut:
    return await collections.update(name, body, principal)


@router.delete("/{name}")
async def delete_collection(name: CollectionName, collections: CollectionsDep,
                            principal: PrincipalDep) -> CollectionDeleted:
    return await collections.delete(name, principal)
