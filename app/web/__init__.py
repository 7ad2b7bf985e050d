"""The chat page: static HTML/JS/CSS shipped in the package, served at / without the API key (the page
asks for the key and sends it on every API call)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

from app.security_headers import CHAT_PAGE_CSP

STATIC_DIR = Path(__file__).parent / "static"


def install_web(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html",
                            headers={"Cache-Control": "no-cache", "Content-Security-Policy": CHAT_PAGE_CSP})
