"""/healthz (alive), /readyz (model, index and store loaded), /metrics (Prometheus). No API key."""

from __future__ import annotations

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from app.deps import MetricsDep
from app.health.protocol import Health, Readiness

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> Health:
    return Health(status="ok")


# exclude_none: a field that does not apply (the counts with a key set, the error while ready) is left out
@router.get("/readyz", response_model=Readiness, response_model_exclude_none=True,
            responses={503: {"model": Readiness}})
async def readyz(request: Request):
    components = getattr(request.app.state, "components", None)
    if components is None:
        error = getattr(request.app.state, "load_error", None)
        status = "failed" if error else "loading"
        return JSONResponse(Readiness(status=status, error=error).model_dump(exclude_none=True), status_code=503)
    store = components.retriever.store
    if not getattr(request.app.state, "is_measured", True):  # requests queue behind the start-up measurement
        measuring = Readiness(status="measuring", model=components.model_id)
        return JSONResponse(measuring.model_dump(exclude_none=True), status_code=503)
    if components.settings.server.api_key:  # no key asked here: counts over every collection are no one's business
        return Readiness(status="ready", model=components.model_id)
    return Readiness(status="ready", model=components.model_id, num_documents=store.num_documents(),
                     num_chunks=store.num_chunks(), num_indexed=components.retriever.index.num_vectors)


metrics_router = APIRouter(tags=["health"])


@metrics_router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(metrics: MetricsDep) -> Response:
    # Rendering reads every collector (the store's and engine's too) and formats every series: in a
    # worker thread, so a scrape never holds the event loop (health checks, streams) while it runs.
    return Response(await anyio.to_thread.run_sync(metrics.render), media_type=CONTENT_TYPE_LATEST)
