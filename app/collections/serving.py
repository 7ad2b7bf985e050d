"""Collections: their rows in the document store, their counts, and their deletion (through the write
queue, like a document's: app/documents/writes.py DocumentWriter.delete_collection)."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, replace

import anyio

from app.auth.principal import Principal, Role
from app.collections.protocol import CollectionCreate, CollectionDeleted, CollectionList, CollectionOut, CollectionUpdate
from app.collections.scope import Scopes, not_found
from app.documents.serving import DocumentService
from app.errors import ConflictError, InvalidRequestError
from retrieval.store_types import (
    DEFAULT_COLLECTION, CollectionCounts, CollectionExistsError, CollectionRow, DocumentStore,
)

# The one salt of the collections that share KV: their entries are content-addressed across them.
SHARED_KV_SALT = "shared"


@dataclass
class CollectionService:
    documents: DocumentService
    scopes: Scopes

    @property
    def store(self) -> DocumentStore:
        return self.documents.retriever.store

    async def create(self, body: CollectionCreate, principal: Principal) -> CollectionOut:
        salt = SHARED_KV_SALT if body.shares_kv else secrets.token_hex(16)
        row = CollectionRow(body.name, body.description, time.time(), salt, body.shares_kv, body.kv_budget_bytes)
        try:
            await anyio.to_thread.run_sync(self.store.create_collection, row)
        except CollectionExistsError:
            raise ConflictError(f"collection exists: {body.name}") from None
        return await anyio.to_thread.run_sync(self._out, row, principal)

    async def list(self, principal: Principal) -> CollectionList:
        return await anyio.to_thread.run_sync(self._list, principal)

    def _list(self, principal: Principal) -> CollectionList:
        rows = [row for row in self.store.list_collections() if principal.sees(row.name)]
        counts = self.store.collection_counts([row.name for row in rows])
        return CollectionList(collections=[self._out(row, principal, counts[row.name]) for row in rows])

    async def get(self, name: str, principal: Principal) -> CollectionOut:
        row = await self.scopes.one(principal, name, Role.READ)
        return await anyio.to_thread.run_sync(self._out, row, principal)

    async def update(self, name: str, body: CollectionUpdate, principal: Principal) -> CollectionOut:
        row = await self.scopes.one(principal, name, Role.ADMIN)
        if body.shares_kv is not None and body.shares_kv != row.shares_kv:
            raise InvalidRequestError("shares_kv is chosen when a collection is created (its chunks' KV keys depend "
                                      "on it): create another collection and ingest into it")
        fields = body.model_fields_set
        updated = replace(row, description=body.description if "description" in fields and body.description is not None
                          else row.description,
                          kv_budget_bytes=body.kv_budget_bytes if "kv_budget_bytes" in fields else row.kv_budget_bytes)
        if not await anyio.to_thread.run_sync(self.store.update_collection, updated):
            raise not_found(name)
        return await anyio.to_thread.run_sync(self._out, updated, principal)

    async def delete(self, name: str, principal: Principal) -> CollectionDeleted:
        await self.scopes.one(principal, name, Role.ADMIN)
        if name == DEFAULT_COLLECTION:
            raise ConflictError("the default collection cannot be deleted (documents sent without a collection land "
                                "there); delete its documents instead")
        counts = (await anyio.to_thread.run_sync(self.store.collection_counts, [name]))[name]
        chunks = await self.documents.delete_collection(name)
        if chunks is None:  # deleted meanwhile (another replica)
            raise not_found(name)
        return CollectionDeleted(name=name, deleted=True, num_documents=counts.num_documents, num_chunks=len(chunks))

    def _out(self, row: CollectionRow, principal: Principal, counts: CollectionCounts | None = None) -> CollectionOut:
        counts = counts or self.store.collection_counts([row.name])[row.name]
        keys = sorted(self.store.kv_keys([row.name]))
        kv_bytes = sum(n or 0 for n in self.documents.kv_store.entry_bytes(keys)) if keys else 0
        access = principal.role.value if not principal.is_server else Role.ADMIN.value
        return CollectionOut(name=row.name, description=row.description, created_at=row.created_at,
                             num_documents=counts.num_documents, num_chunks=counts.num_chunks,
                             num_tokens=counts.num_tokens, kv_bytes=kv_bytes, shares_kv=row.shares_kv,
                             kv_budget_bytes=row.kv_budget_bytes, access=access)
