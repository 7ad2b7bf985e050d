"""Dependencies: every shared object is built in the lifespan and reached through these aliases."""

from __future__ import annotations

import hmac
from typing import Annotated

import anyio
from fastapi import Depends, Header, Request

from app.auth.principal import SERVER, Principal, Role
from app.auth.tokens import key_id_of, matches
from app.chat.serving import ChatService
from app.collections.scope import Scopes
from app.collections.serving import CollectionService
from app.completions.serving import CompletionService
from app.components import Components
from app.documents.limits import KVBudget
from app.documents.serving import DocumentService
from app.errors import AuthenticationError, NotReadyError, PermissionDeniedError
from app.keys.serving import KeyService
from app.metrics import Metrics
from app.query.serving import QueryService
from app.uploads.serving import UploadService
from configs.settings import Settings


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def get_components(request: Request) -> Components:
    components = getattr(request.app.state, "components", None)
    if components is None:
        error = getattr(request.app.state, "load_error", None)
        raise NotReadyError(f"server failed to start: {error}" if error else "server is still loading; retry shortly")
    return components


SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
ComponentsDep = Annotated[Components, Depends(get_components)]


def get_documents(components: ComponentsDep) -> DocumentService:
    return components.documents


def get_query(components: ComponentsDep) -> QueryService:
    return components.query


def get_chat(components: ComponentsDep) -> ChatService:
    return components.chat


def get_completions(components: ComponentsDep) -> CompletionService:
    return components.completions


def get_scopes(components: ComponentsDep) -> Scopes:
    return components.scopes


def get_collections(components: ComponentsDep) -> CollectionService:
    return components.collections


def get_keys(components: ComponentsDep) -> KeyService:
    return components.keys


def get_uploads(settings: SettingsDep, components: ComponentsDep) -> UploadService:
    return UploadService(settings, components.documents)


def get_kv_budget(components: ComponentsDep) -> KVBudget | None:
    return KVBudget.of(components.settings, components.engine)


DocumentsDep = Annotated[DocumentService, Depends(get_documents)]
UploadsDep = Annotated[UploadService, Depends(get_uploads)]
KVBudgetDep = Annotated[KVBudget | None, Depends(get_kv_budget)]
QueryDep = Annotated[QueryService, Depends(get_query)]
ChatDep = Annotated[ChatService, Depends(get_chat)]
CompletionsDep = Annotated[CompletionService, Depends(get_completions)]
ScopesDep = Annotated[Scopes, Depends(get_scopes)]
CollectionsDep = Annotated[CollectionService, Depends(get_collections)]
KeysDep = Annotated[KeyService, Depends(get_keys)]


async def get_principal(
    request: Request, settings: SettingsDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Principal:
    """Who sends the request (every route but the health ones and the page): the server's key
    (`server.api_key`) may do everything; a scoped key (`/v1/keys`), looked up in the document store at
    each request (so a revocation through any replica holds at the next one), is bound to its
    collections and role. Without `server.api_key` a request with no key (or an unknown one) is the
    server's, as before keys existed; a scoped key still restricts what it may do."""
    expected = settings.server.api_key
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if token and expected and hmac.compare_digest(token.encode(), expected.encode()):
        return SERVER
    key_id = key_id_of(token) if token else None
    if key_id is not None:
        store = get_components(request).retriever.store  # 503 while loading: keys live in the store
        key = await anyio.to_thread.run_sync(store.get_key, key_id)
        if key is not None and key.revoked_at is None and matches(token, key.token_hash):
            return Principal(key.id, Role(key.role), frozenset(key.collections))
    if not expected:
        return SERVER
    raise AuthenticationError("missing, wrong or revoked API key: send 'Authorization: Bearer <key>'")


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_api_key(principal: PrincipalDep) -> None:
    """Any valid key (the router-level check; routes narrow it by collection and role)."""


async def require_server_key(principal: PrincipalDep) -> None:
    """Only the server's own key: key management, creating collections, /metrics (counts over every
    collection)."""
    if not principal.is_server:
        raise PermissionDeniedError("only the server's API key (server.api_key) may do this")
