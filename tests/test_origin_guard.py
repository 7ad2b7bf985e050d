"""Drive-by writes and DNS rebinding, against a live server in the default config (loopback, no key):
a state-changing request from a foreign browser origin and any request under an unknown Host name get
a 403 and change nothing, over plain HTTP and from pages in a real headless Chromium; the server's own
page, clients without an Origin (curl, `ragblend`) and the configured origins and hosts pass."""

from __future__ import annotations

import httpx
import pytest

from app.origin_guard import allowed_host_names, host_name
from app.testing import LiveServer, free_port
from app.config import ServerConfig
from configs.settings import load_settings
from tests.browser import launched, page_site

TEXT = b"The planted document says the vault code is 0000."


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("origin"),
                             model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"chunking": "none"},
                             server={"allowed_origins": ["http://trusted.example:3000"],
                                     "allowed_hosts": ["localhost", "127.0.0.1", "rag.internal"]})
    with LiveServer(settings) as live:
        yield live


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def upload(http: httpx.Client, name: str, **headers: str) -> httpx.Response:
    return http.post("/v1/documents/files", files=[("files", (name, TEXT))], data={"precompute": "false"},
                     headers=headers)


def is_stored(http: httpx.Client, doc_id: str) -> bool:
    return http.get(f"/v1/documents/{doc_id}").status_code == 200


def test_a_foreign_origin_cannot_upload_or_delete(http):
    refused = upload(http, "planted.txt", origin="http://evil.example")
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["type"] == "permission_error" and "http://evil.example" in error["message"]
    assert "server.allowed_origins" in error["message"]
    assert not is_stored(http, "planted.txt")
    assert upload(http, "kept.txt").status_code == 201  # no Origin: curl, ragblend
    for origin in ("http://evil.example", "null", f"http://localhost:{free_port()}"):
        assert http.delete("/v1/documents/kept.txt", headers={"origin": origin}).status_code == 403, origin
    assert is_stored(http, "kept.txt")
    no_origin = http.post("/v1/query", json={"question": "x"}, headers={"sec-fetch-site": "cross-site"})
    assert no_origin.status_code == 403  # a browser that left the Origin out still says where it comes from


def test_the_servers_own_origin_and_the_configured_ones_may(server, http):
    assert upload(http, "own.txt", origin=server.url).status_code == 201
    assert upload(http, "trusted.txt", origin="http://trusted.example:3000").status_code == 201
    assert http.delete("/v1/documents/own.txt", headers={"origin": server.url,
                                                           "sec-fetch-site": "same-origin"}).status_code == 200
    assert http.get("/v1/documents", headers={"origin": "http://evil.example"}).status_code == 200  # reads: CORS


def test_an_unknown_host_name_is_refused_even_for_reads(server, http):
    for path in ("/", "/v1/documents", "/healthz"):
        response = http.get(path, headers={"host": f"rebind.example:{server.port}"})
        assert response.status_code == 403, path
        assert "server.allowed_hosts" in response.json()["error"]["message"]
    assert upload(http, "rebound.txt", host=f"rebind.example:{server.port}",
                  origin=f"http://rebind.example:{server.port}").status_code == 403
    assert not is_stored(http, "rebound.txt")
    assert http.get("/v1/documents", headers={"host": f"rag.internal:{server.port}"}).status_code == 200
    assert http.get("/v1/documents", headers={"host": f"[::1]:{server.port}"}).status_code == 403  # not listed here


def test_default_host_names():
    assert allowed_host_names(ServerConfig()) == {"localhost", "127.0.0.1", "::1"}
    assert allowed_host_names(ServerConfig(host="10.0.0.5", api_key="k")) == {"localhost", "127.0.0.1", "::1",
                                                                                 "10.0.0.5"}
    assert allowed_host_names(ServerConfig(host="0.0.0.0", api_key="k")) is None  # any: the key guards
    assert allowed_host_names(ServerConfig(allowed_hosts=["*"])) is None
    assert [host_name(h) for h in ("Example.org:80", "[::1]:8000", "::1", "x")] == ["example.org", "::1", "::1", "x"]


# ---- the same through a real browser ------------------------------------------------------------

ATTACK_PAGE = """<!doctype html><title>cute cats</title><script>
async function attack(target) {
  const form = new FormData();
  form.append("files", new Blob([%r], {type: "text/plain"}), "drive-by.txt");
  form.append("precompute", "false");
  // a "simple" request: no preflight, the page cannot read the answer but the write would happen
  await fetch(target + "/v1/documents/files", {method: "POST", body: form, mode: "no-cors"});
  await fetch(target + "/v1/documents/kept.txt", {method: "DELETE", mode: "no-cors"}).catch(() => {});
  return "sent";
}
</script>""" % TEXT.decode()


@pytest.fixture(scope="module")
def attacker_site():
    """Another origin on loopback (another port), serving the page above."""
    with page_site(ATTACK_PAGE) as url:
        yield url


# ---- in a real browser ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    # rebind.test resolves to loopback, as a DNS-rebinding name does once it flips
    with launched(("--host-resolver-rules=MAP rebind.test 127.0.0.1",)) as browser:
        yield browser


def test_a_page_from_another_origin_cannot_plant_or_delete_documents(server, http, browser, attacker_site):
    assert upload(http, "kept.txt").status_code == 201
    page = browser.new_page()
    try:
        page.goto(attacker_site + "/")
        assert page.evaluate("target => attack(target)", server.url) == "sent"
    finally:
        page.close()
    assert not is_stored(http, "drive-by.txt")
    assert is_stored(http, "kept.txt")


def test_a_rebinding_name_gets_nothing_from_the_browser(server, http, browser):
    page = browser.new_page()
    try:
        response = page.goto(f"http://rebind.test:{server.port}/")
        assert response.status == 403
        status = page.evaluate("""async () => (await fetch('/v1/documents')).status""")
        assert status == 403
    finally:
        page.close()


def test_the_servers_own_page_still_writes_from_the_browser(server, http, browser):
    page = browser.new_page()
    try:
        page.goto(server.url + "/")
        status = page.evaluate("""async () => {
            const form = new FormData();
            form.append("files", new Blob(["Own page text."], {type: "text/plain"}), "own-page.txt");
            return (await fetch("/v1/documents/files", {method: "POST", body: form})).status;
        }""")
        assert status == 201
    finally:
        page.close()
    assert is_stored(http, "own-page.txt")
