"""Playwright on the system Chromium (Debian's `chromium`; no browser download): the launch, or the
reason none can start, which the browser tests print when they skip."""

from __future__ import annotations

import os
import shutil

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    explicit = os.environ.get("RAGBLEND_CHROMIUM")
    if explicit:
        return explicit
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


def launch(playwright, args: tuple[str, ...] = ()):
    """(browser, None), or (None, why not). `args`: more Chromium switches."""
    path = chromium_path()
    if path is None:
        return None, "no chromium on PATH (apt-get install chromium, or set RAGBLEND_CHROMIUM)"
    try:
        return playwright.chromium.launch(executable_path=path, args=["--no-sandbox", *args]), None
    except Exception as exc:  # any failure to start is a reason to skip, printed in full
        return None, f"chromium at {path} did not start: {type(exc).__name__}: {str(exc)[:300]}"
