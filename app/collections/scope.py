"""Which collections a request works on: those it names (`collection`), else the caller's default
(the server's key: `default`; a scoped key: its own collections). A collection the caller may not see
reads exactly as one that does not exist (404 naming it as asked), so no key learns what other
collections exist; a visible collection the key's role may not change is a 403."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import anyio

from app.auth.principal import Principal, Role
from app.errors import InvalidRequestError, NotFoundError, PermissionDeniedError
from retrieval.store_types import DEFAULT_COLLECTION, CollectionRow, DocumentStore

_ACTIONS = {Role.READ: "read", Role.WRITE: "change documents in", Role.ADMIN: "administer"}


def not_found(name: str) -> NotFoundError:
    return NotFoundError(f"collection not found: {name}")


def none_left() -> NotFoundError:
    """A scoped key whose collections were all deleted (their grants go with them), asked to work on its own."""
    return NotFoundError("this key's collections were all deleted: it has none left to work on (a collection made "
                         "again under a deleted one's name is not the key's)")


@dataclass
class Scopes:
    store: DocumentStore

    async def readable(self, principal: Principal, requested: Sequence[str] | None) -> list[CollectionRow]:
        """The collections a question or a listing works on (each visible to the caller, else 404)."""
        return await anyio.to_thread.run_sync(self._readable, principal, requested)

    async def searched(self, principal: Principal, requested: Sequence[str] | None) -> list[CollectionRow]:
        """The collections a question searches: as `readable`, and one at least. A scoped key left with
        none gets a 404 saying so, rather than the not-found answer of a search over nothing, which
        reads as if its documents did not hold the answer."""
        rows = await self.readable(principal, requested)
        if not rows:
            raise none_left()
        return rows

    async def one(self, principal: Principal, requested: str | None, role: Role) -> CollectionRow:
        """The one collection a write (or an administration) works on; the caller's role must allow it."""
        return await anyio.to_thread.run_sync(self._one, principal, requested, role)

    def _readable(self, principal: Principal, requested: Sequence[str] | None) -> list[CollectionRow]:
        if requested:
            return [self._visible(principal, name) for name in dict.fromkeys(requested)]
        if principal.is_server:
            return [self._visible(principal, DEFAULT_COLLECTION)]
        rows = [self.store.get_collection(name) for name in sorted(principal.collections)]
        return [row for row in rows if row is not None]

    def _one(self, principal: Principal, requested: str | None, role: Role) -> CollectionRow:
        name = requested
        if name is None:
            if principal.is_server:
                name = DEFAULT_COLLECTION
            elif len(principal.collections) == 1:
                name = next(iter(principal.collections))
            elif not principal.collections:
                raise none_left()
            else:
                raise InvalidRequestError(f"this key has {len(principal.collections)} collections: name one with "
                                          "`collection`")
        row = self._visible(principal, name)
        if not principal.may(role, name):
            raise PermissionDeniedError(f"this key's role ({principal.role.value}) may not {_ACTIONS[role]} "
                                        f"collection {name}")
        return row

    def _visible(self, principal: Principal, name: str) -> CollectionRow:
        if not principal.sees(name):
            raise not_found(name)
        row = self.store.get_collection(name)
        if row is None:
            raise not_found(name)
        return row
