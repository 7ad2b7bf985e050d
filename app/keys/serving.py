"""API keys: created (the token shown once, its sha256 stored), listed, revoked; in the document store,
so every replica sees a revocation at its next request."""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio

from app.auth.tokens import new_token, token_hash
from app.errors import NotFoundError
from app.keys.protocol import KeyCreate, KeyCreated, KeyList, KeyOut, KeyRevoked
from retrieval.store_types import CollectionNotFoundError, DocumentStore, KeyRow


@dataclass
class KeyService:
    store: DocumentStore

    async def create(self, body: KeyCreate) -> KeyCreated:
        key_id, token = new_token()
        row = KeyRow(key_id, body.name, token_hash(token), body.role.value, tuple(sorted(set(body.collections))),
                     time.time())
        try:
            await anyio.to_thread.run_sync(self.store.create_key, row)
        except CollectionNotFoundError as exc:
            raise NotFoundError(str(exc)) from None
        return KeyCreated(**_out(row).model_dump(), key=token)

    async def list(self) -> KeyList:
        return KeyList(keys=[_out(row) for row in await anyio.to_thread.run_sync(self.store.list_keys)])

    async def revoke(self, key_id: str) -> KeyRevoked:
        if not await anyio.to_thread.run_sync(self.store.revoke_key, key_id, time.time()):
            row = await anyio.to_thread.run_sync(self.store.get_key, key_id)
            if row is None:
                raise NotFoundError(f"key not found: {key_id}")
        return KeyRevoked(id=key_id, revoked=True)


def _out(row: KeyRow) -> KeyOut:
    return KeyOut(id=row.id, name=row.name, role=row.role, collections=list(row.collections),
                  created_at=row.created_at, revoked_at=row.revoked_at)
