"""/v1/keys: scoped API keys, managed with the server's own key (server.api_key) only, and made only on a
server that has one (decision 0029)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, status

from app.deps import KeysDep, require_keyed_server, require_server_key
from app.errors import ERROR_RESPONSES
from app.keys.protocol import KEY_ID_PATTERN, KeyCreate, KeyCreated, KeyList, KeyRevoked

router = APIRouter(prefix="/v1/keys", tags=["keys"], responses=ERROR_RESPONSES,
                   dependencies=[Depends(require_server_key)])


@router.post("", status_code=status.HTTP_201_CREATED, dependencies=[Depends(require_keyed_server)])
async def create_key(body: KeyCreate, keys: KeysDep) -> KeyCreated:
    return await keys.create(body)


@router.get("")
async def list_keys(keys: KeysDep) -> KeyList:
    return await keys.list()


@router.delete("/{key_id}")
async def revoke_key(key_id: Annotated[str, Path(pattern=KEY_ID_PATTERN)], keys: KeysDep) -> KeyRevoked:
    return await keys.revoke(key_id)
