"""The FastAPI app: `create_app(settings)`. The lifespan loads the model and the stores in a thread
(so /healthz answers and /readyz says 'loading' meanwhile) and closes them in `finally`."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import AsyncIterator, TYPE_CHECKING

import anyio
from fastapi import Depends, FastAPI

from app.apidocs.api_router import router as apidocs_router
from app.chat.api_router import router as chat_router
from app.collections.api_router import router as collections_router
from app.completions.api_router import router as completions_router
from app.components import Components
from app.deps import require_api_key, require_server_key
from app.documents.api_router import router as documents_router
from app.errors import install_error_handlers
from app.health.api_router import metrics_router, router as health_router
from app.keys.api_router import router as keys_router
from app.metrics import Metrics
from app.middleware import BodyGuardMiddleware, MetricsMiddleware
from app.origin_guard import OriginGuardMiddleware
from app.security_headers import SecurityHeadersMiddleware
from app.models.api_router import router as models_router
from app.query.api_router import router as query_router
from app.uploads.api_router import router as uploads_router
from app.web import install_web
from configs.settings import Settings

if TYPE_CHECKING:
    from blend_engine.engine import BlendEngine

logger = logging.getLogger(__name__)


async def _load(app: FastAPI, settings: Settings, engine: BlendEngine | None) -> None:
    try:
        components = await anyio.to_thread.run_sync(Components.build, settings, app.state.metrics, engine)
    except Exception as exc:
        logger.exception("start-up failed")
        app.state.load_error = str(exc) or "see the server log"  # /readyz shows it: no class names
        return
    app.state.components = components
    # The loading planner's cost model, measured once on the engine loop before any question (which
    # queue behind it) rather than inside the first one; /readyz says ready only once it is done
    # (a failed measurement is logged by the loop and leaves the planner on its defaults).
    measuring = components.loop.submit(lambda job: components.executor.measure_engine())
    measuring.future.add_done_callback(lambda _: setattr(app.state, "is_measured", True))
    logger.info("ready: model %s, %d chunks indexed", components.model_id, components.retriever.index.num_vectors)


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    app.state.components, app.state.load_error, app.state.is_measured = None, None, False
    loading = asyncio.create_task(_load(app, settings, app.state.preloaded_engine))
    try:
        yield
    finally:
        await asyncio.shield(loading)  # a load in progress cannot be interrupted: let it finish, then close
        components = app.state.components
        app.state.components = None
        if components is not None:
            await anyio.to_thread.run_sync(components.close)


def create_app(settings: Settings, engine: BlendEngine | None = None) -> FastAPI:
    """The app; nothing is loaded until it starts. `engine`: reuse an already loaded BlendEngine."""
    app = FastAPI(
        title="ragblend",
        version="0.1.0",
        description="RAG server with a CacheBlend engine: stored chunk KV caches fused with selective recompute.",
        lifespan=_lifespan,
        # served by apidocs_router, behind the API key and without a CDN
        openapi_url=None, docs_url=None, redoc_url=None,
    )
    app.state.settings, app.state.preloaded_engine = settings, engine
    app.state.metrics = Metrics()
    install_error_handlers(app)
    app.add_middleware(
        BodyGuardMiddleware, max_bytes=settings.limits.max_body_bytes, read_timeout_s=settings.server.body_timeout_s,
        path_limits={"/v1/documents/files": settings.limits.max_upload_bytes},
    )
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(OriginGuardMiddleware, server=settings.server)  # refused before anything runs
    app.add_middleware(SecurityHeadersMiddleware)  # outermost: on every response, refusals included
    app.include_router(health_router)
    # /metrics counts over every collection: the server's key only (a scoped key learns nothing of others)
    app.include_router(metrics_router, dependencies=[Depends(require_server_key)])
    protected = [Depends(require_api_key)]
    for router in (uploads_router, documents_router, collections_router, keys_router, query_router, chat_router,
                   completions_router, models_router, apidocs_router):
        app.include_router(router, dependencies=protected)
    install_web(app)  # the chat page at /: no key needed to load it; it asks for the key
    return app
