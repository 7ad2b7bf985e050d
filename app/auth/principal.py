"""Who a request is: the server's own key (`server.api_key`; on a server without one, a request with no
key while the store holds no live scoped key: app/deps.py get_principal) may do everything; a scoped
key (`/v1/keys`) is bound to collections with a role. Read asks and lists, write also ingests and
deletes documents, admin also changes and deletes its collections. Only the server's key creates
collections and keys and reads /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Role(str, Enum):
    READ = "read"  # ask (query, chat, completions), list and read documents
    WRITE = "write"  # and ingest, upload, delete documents
    ADMIN = "admin"  # and change or delete its collections

    @property
    def rank(self) -> int:
        return (Role.READ, Role.WRITE, Role.ADMIN).index(self)


@dataclass(frozen=True)
class Principal:
    key_id: str | None  # None: the server's own key (get_principal says when): every collection and route
    role: Role = Role.ADMIN
    collections: frozenset[str] = frozenset()  # a scoped key's; the server's key sees every collection

    @property
    def is_server(self) -> bool:
        return self.key_id is None

    def sees(self, collection: str) -> bool:
        """Whether the collection exists for this caller at all (others read as not found, never forbidden)."""
        return self.is_server or collection in self.collections

    def may(self, role: Role, collection: str) -> bool:
        return self.sees(collection) and (self.is_server or self.role.rank >= role.rank)


SERVER = Principal(key_id=None)
