"""Dependencies: every shared object is built in the lifespan and reached through these aliases."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, Header, Request

from app.chat.serving import ChatService
from app.components import Components
from app.documents.limits import KVBudget
from app.documents.serving import DocumentService
from app.errors import AuthenticationError, NotReadyError
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


def get_uploads(settings: SettingsDep, components: ComponentsDep) -> UploadService:
    return UploadService(settings, components.documents)


def get_kv_budget(components: ComponentsDep) -> KVBudget | None:
    return KVBudget.of(components.settings, components.engine)


DocumentsDep = Annotated[DocumentService, Depends(get_documents)]
UploadsDep = Annotated[UploadService, Depends(get_uploads)]
KVBudgetDep = Annotated[KVBudget | None, Depends(get_kv_budget)]
QueryDep = Annotated[QueryService, Depends(get_query)]
ChatDep = Annotated[ChatService, Depends(get_chat)]


async def require_api_key(
    settings: SettingsDep, authorization: Annotated[str | None, Header(include_in_schema=False)] = None
) -> None:
    """When `server.api_key` is set, every route but the health ones needs `Authorization: Bearer KEY`."""
    expected = settings.server.api_key
    if not expected:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected.encode()):
        raise AuthenticationError("missing or wrong API key: send 'Authorization: Bearer <key>'")
