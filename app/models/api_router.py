"""/v1/models: the served model."""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import ComponentsDep
from app.errors import ERROR_RESPONSES
from app.models.protocol import ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"], responses=ERROR_RESPONSES)


@router.get("/models")
async def list_models(components: ComponentsDep) -> ModelList:
    return ModelList(data=[ModelCard(id=components.model_id, created=int(components.started_at))])
