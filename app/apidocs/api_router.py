"""/openapi.json and /docs (Swagger UI), behind the API key like every route but the health ones.

Swagger UI's files come from the swagger-ui-bundle-v2 package and are served here: the page works
offline and loads nothing from a CDN. ReDoc ships no such package, so /redoc is off.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse
from swagger_ui_bundle import swagger_ui_path

from app.errors import NotFoundError

ASSETS_PREFIX = "/docs/assets"
# The files the page loads; nothing else of the package's folder is served.
ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}

router = APIRouter(include_in_schema=False)


@router.get("/openapi.json")
async def openapi_schema(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(
        openapi_url="/openapi.json", title=f"{request.app.title} API",
        swagger_js_url=f"{ASSETS_PREFIX}/swagger-ui-bundle.js", swagger_css_url=f"{ASSETS_PREFIX}/swagger-ui.css",
        swagger_favicon_url=f"{ASSETS_PREFIX}/favicon-32x32.png",
    )


@router.get(ASSETS_PREFIX + "/{name}")
async def swagger_asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise NotFoundError(f"no such docs asset: {name}")
    return FileResponse(Path(swagger_ui_path) / name, media_type=ASSETS[name])
