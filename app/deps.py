"""Dependencies: every shared object is built in the lifespan and reached through these aliases."""

from __future__ import annotations

import hmac
from typing import Annotated

import anyio
from fastapi import Depends, Header, Request

from app.auth.principal import SERVER, Principal, Role
from app.auth.tokens import PREFIX, key_id_of, matches
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


BAD_KEY = "missing, wrong or revoked API key: send 'Authorization: Bearer <key>'"
# How to give a server its own key, in every error that needs one (docs/getting-started.md shows it).
SET_SERVER_KEY = ("restart it with RAGBLEND_SERVER__API_KEY set to a long random secret (or server.api_key in its "
                  "--config file) and send that key (the CLI: --api-key or RAGBLEND_API_KEY)")


async def get_principal(
    request: Request, settings: SettingsDep,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Principal:
    """Who sends the request (every route but the health ones and the page), decision 0029:
    - the server's key (`server.api_key`) may do everything;
    - a scoped key's token (`rbk_...`) is that key, looked up in the document store at each request (so
      a revocation through any replica holds at the next one), bound to its collections and role; an
      unknown, revoked or malformed one is a 401 on every server, keyed or not: never the server's;
    - anything else (no token, or another one: an OpenAI client must send some key) is a 401 where
      `server.api_key` is set. Without it (a one-user server on loopback) the request is the server's
      while the store holds no live scoped key; once it holds one (made while a key was set, or before
      keys needed one) every request needs a key, so that a scoped key keeps out what it was made to."""
    expected = settings.server.api_key
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip() if scheme.lower() == "bearer" else ""
    if token and expected and hmac.compare_digest(token.encode(), expected.encode()):
        return SERVER
    if token.startswith(PREFIX):
        key_id = key_id_of(token)
        if key_id is not None:
            store = get_components(request).retriever.store  # 503 while loading: keys live in the store
            key = await anyio.to_thread.run_sync(store.get_key, key_id)
            if key is not None and key.revoked_at is None and matches(token, key.token_hash):
                return Principal(key.id, Role(key.role), frozenset(key.collections))
        raise AuthenticationError(BAD_KEY)
    if expected:
        raise AuthenticationError(BAD_KEY)
    store = get_components(request).retriever.store  # asked at each request, as a key is: replicas agree
    if await anyio.to_thread.run_sync(store.has_live_keys):
        raise AuthenticationError(f"this server holds scoped API keys but has no key of its own: send a scoped key, "
                                  f"or {SET_SERVER_KEY}")
    return SERVER


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_api_key(principal: PrincipalDep) -> None:
    """Any valid key (the router-level check; routes narrow it by collection and role)."""


async def require_keyed_server(settings: SettingsDep) -> None:
    """Scoped keys are made only on a server with a key of its own: without one, a request with no key
    may do everything, so a scoped key would protect nothing (decision 0029)."""
    if not settings.server.api_key:
        raise PermissionDeniedError(f"this server has no API key of its own (server.api_key), so a request "
                                    f"without a key may do everything and a scoped key would protect nothing: "
                                    f"{SET_SERVER_KEY}, then create keys with that key")


async def require_server_key(principal: PrincipalDep) -> None:
    """Only the server's own key: key management, creating collections, /metrics (counts over every
    collection)."""
    if not principal.is_server:
        raise PermissionDeniedError("only the server's API key (server.api_key) may do this")
