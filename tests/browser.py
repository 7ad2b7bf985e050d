"""Playwright on the system Chromium (Debian's `chromium`; no browser download): the launch, or the
reason none can start, which the browser tests print when they skip."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

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


@contextlib.contextmanager
def launched(args: tuple[str, ...] = ()) -> Iterator[object]:
    """A Chromium for a module's tests (`launch`'s `args`), closed after; the tests skip, printing why,
    where none starts (no playwright, no chromium)."""
    playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    with playwright_api.sync_playwright() as playwright:
        browser, reason = launch(playwright, args)
        if browser is None:
            print(f"\nSKIP browser tests: {reason}")
            pytest.skip(reason)
        try:
            yield browser
        finally:
            browser.close()


@contextlib.contextmanager
def page_site(body: str) -> Iterator[str]:
    """`body` (an HTML page) served at every path on its own loopback port: another origin than the
    server's. Yields its base URL."""
    page = body.encode()

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args):
            pass

    site = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=site.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{site.server_address[1]}"
    finally:
        site.shutdown()
        site.server_close()


def wait_until(page, expression: str, timeout: float = 30_000, poll_s: float = 0.02) -> None:
    """`page.wait_for_function` without its in-page `new Function`, which the chat page's policy (CSP
    `script-src 'self'`, no 'unsafe-eval') refuses: `expression` is evaluated over the DevTools protocol
    (`page.evaluate`), which the page's CSP does not govern, until it is truthy. `timeout`: ms, as Playwright's."""
    deadline = time.monotonic() + timeout / 1000
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout / 1000:g} s: {expression}")
        time.sleep(poll_s)
