"""Browser hardening headers: every response (the chat page, its files, the API, errors and refusals)
carries `X-Content-Type-Options: nosniff`, `X-Frame-Options: DENY`, a CSP with `frame-ancestors 'none'`
and a `Referrer-Policy`; the chat page's CSP allows its own scripts and styles only. In a real headless
Chromium the page runs under that policy without a violation, and a page of another origin that frames
it gets nothing. The model is left unloadable: nothing here needs it (the whole page under the policy is
driven by tests/test_chat_page.py)."""

from __future__ import annotations

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings
from tests.browser import launched, page_site, wait_until

API_KEY = "headers-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EVERYWHERE = {"x-content-type-options": "nosniff", "x-frame-options": "DENY", "referrer-policy": "same-origin"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("headers")
    settings = load_settings(data_dir=tmp, model={"name": str(tmp / "missing.gguf")}, server={"api_key": API_KEY})
    with LiveServer(settings, is_waiting=False) as live:
        async def boom() -> None:
            raise RuntimeError("a bug")

        live.app.add_api_route("/test-boom", boom)  # a 500: answered from outside the middleware
        yield live


def csp_directives(response: httpx.Response) -> dict[str, str]:
    policy = response.headers["content-security-policy"]
    return {part.split()[0]: " ".join(part.split()[1:]) for part in policy.split(";") if part.strip()}


def test_the_chat_page_has_a_strict_policy(server):
    response = httpx.get(f"{server.url}/", timeout=30)
    assert response.status_code == 200
    directives = csp_directives(response)
    assert directives["default-src"] == "'none'" and directives["frame-ancestors"] == "'none'"
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"  # no inline code
    assert directives["connect-src"] == "'self'" and directives["base-uri"] == "'none'"
    assert all(response.headers[name] == value for name, value in EVERYWHERE.items())


@pytest.mark.parametrize(("method", "path", "headers", "status"), [
    ("GET", "/static/chat.js", {}, 200),
    ("GET", "/healthz", {}, 200),
    ("GET", "/readyz", {}, 503),
    ("GET", "/v1/documents", {}, 401),
    ("GET", "/docs", AUTH, 200),
    ("GET", "/nowhere", {}, 404),
    ("POST", "/v1/query", {**AUTH, "origin": "http://evil.example"}, 403),  # the origin guard's refusal
    ("POST", "/v1/query", {**AUTH, "content-type": "application/json"}, 400),
    ("GET", "/test-boom", {}, 500),
])
def test_every_response_carries_the_headers(server, method, path, headers, status):
    response = httpx.request(method, f"{server.url}{path}", headers=headers, content=b"{", timeout=30)
    assert response.status_code == status, response.text
    assert {name: response.headers.get(name) for name in EVERYWHERE} == EVERYWHERE
    assert csp_directives(response)["frame-ancestors"] == "'none'"


# ---- in a real browser ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    with launched() as browser:
        yield browser


@pytest.fixture(scope="module")
def framing_site(server):
    """Another origin on loopback (another port) whose page frames the chat page."""
    with page_site(f'<!doctype html><title>framing</title><iframe id="victim" src="{server.url}/"></iframe>') as url:
        yield url


def test_the_page_runs_under_its_policy(server, browser):
    """Its scripts run (the status line is filled in from /readyz) and nothing is refused."""
    context = browser.new_context()
    page = context.new_page()
    page.add_init_script("window.__violations = [];"
                         "document.addEventListener('securitypolicyviolation',"
                         " (e) => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));")
    console = []
    page.on("console", lambda message: console.append(message.text))
    try:
        page.goto(server.url + "/")
        wait_until(page, "document.querySelector('#server-status').textContent.includes('failed to start')",
                               timeout=60_000)
        assert page.evaluate("getComputedStyle(document.body).margin") == "0px"  # style.css applied
        assert page.evaluate("window.__violations") == []
        assert not [text for text in console if "Content Security Policy" in text]
    finally:
        context.close()


def test_a_page_of_another_origin_cannot_frame_it(server, browser, framing_site):
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(framing_site + "/")
        page.wait_for_load_state("load")
        frame = page.frame_locator("#victim")
        assert page.locator("#victim").count() == 1  # the frame is there...
        victim = next(f for f in page.frames if f != page.main_frame)
        assert not victim.url.startswith(server.url)  # ...but the browser refused to load the page in it
        assert frame.locator("#ask-form").count() == 0
    finally:
        context.close()
