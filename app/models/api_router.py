"""/v1/models: the served model, and one name per knowledge base the caller sees (`<model>:<collection>`:
an OpenAI client that can set only `model` picks a collection with it)."""

from __future__ import annotations

import anyio
from fastapi import APIRouter

from app.deps import ComponentsDep, PrincipalDep
from app.errors import ERROR_RESPONSES
from app.models.protocol import ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"], responses=ERROR_RESPONSES)


@router.get("/models")
async def list_models(components: ComponentsDep, principal: PrincipalDep) -> ModelList:
    created = int(components.started_at)
    rows = await anyio.to_thread.run_sync(components.retriever.store.list_collections)
    cards = [ModelCard(id=components.model_id, created=created)]
    cards += [ModelCard(id=f"{components.model_id}:{row.name}", created=int(row.created_at), collection=row.name)
              for row in rows if principal.sees(row.name)]
    return ModelList(data=cards)
