"""The chat page's knowledge bases in a real headless Chromium (Playwright on the system's chromium; a tiny
random model): with the server's key, create a knowledge base from the page, upload into it, list it
apart from the others, and ask within it; with a key that may only read it, the page offers no upload
or delete, a dropped file is refused on the page, and the server refuses the upload itself (403).
Skips, with the reason, where no browser can start."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

from app.testing import LiveServer
from configs.settings import load_settings
from tests.browser import launched, wait_until

API_KEY = "page-kb-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(data_dir=tmp_path_factory.mktemp("page-kb"), model={"name": "random:tiny-llama", "device": "cpu"},
                             server={"api_key": API_KEY}, retrieval={"chunking": "none"}, generation={"max_tokens": 2})
    with LiveServer(settings) as live:
        with httpx.Client(base_url=live.url, headers=AUTH, timeout=120) as http:
            response = http.post("/v1/documents", json={"documents": [{"id": "old", "text": "An older default note."}]})
            assert response.status_code == 201
        yield live


@pytest.fixture(scope="module")
def browser():
    with launched() as browser:
        yield browser


def open_page(browser, server, key: str):
    context = browser.new_context()
    page = context.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-input", key)
    page.press("#key-input", "Enter")
    wait_until(page, "document.querySelector('#server-status').textContent.startsWith('ready')")
    wait_until(page, "document.querySelectorAll('#kb-select option').length > 0")
    return context, page


def drop_file(page, name: str, data: bytes) -> None:
    page.evaluate(
        """([name, b64]) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const transfer = new DataTransfer();
            transfer.items.add(new File([bytes], name, { type: "text/plain" }));
            document.getElementById("dropzone").dispatchEvent(new DragEvent("drop", { dataTransfer: transfer, bubbles: true }));
        }""",
        [name, base64.b64encode(data).decode()],
    )


def test_create_a_knowledge_base_upload_into_it_and_ask_within_it(browser, server):
    context, page = open_page(browser, server, API_KEY)
    try:
        assert page.input_value("#kb-select") == "default"
        page.wait_for_selector("#doc-list li[data-id='old']")
        page.click("#kb-new")
        page.fill("#kb-name", "team-notes")
        page.click("#kb-form button[value=create]")
        wait_until(page, "document.querySelector('#kb-select').value === 'team-notes'")
        wait_until(page, "document.querySelectorAll('#doc-list li').length === 0")  # the new one's documents only
        page.set_input_files("#file-input", files=[{"name": "standup.txt", "mimeType": "text/plain",
                                                    "buffer": b"The team standup moves to 10:15 on Thursdays."}])
        page.wait_for_selector("#uploads li.done")
        page.wait_for_selector("#doc-list li[data-id='standup.txt']")
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            assert http.get("/v1/documents/standup.txt", params={"collection": "team-notes"}).status_code == 200
            assert http.get("/v1/documents/standup.txt").status_code == 404  # not in default
        with page.expect_request("**/v1/chat/completions") as request:
            page.fill("#question", "When is the standup?")
            page.press("#question", "Enter")
        assert json.loads(request.value.post_data)["collection"] == "team-notes"
        page.wait_for_selector(".msg.assistant .stats", timeout=60_000)
        assert page.locator(".citation").all_inner_texts() == ["[1] The team standup moves to 10:15 on Thursdays."]
        page.select_option("#kb-select", "default")
        page.wait_for_selector("#doc-list li[data-id='old']")
        assert page.locator("#doc-list li[data-id='standup.txt']").count() == 0
    finally:
        context.close()


def test_a_read_only_key_cannot_upload_from_the_page(browser, server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
        if http.get("/v1/collections/team-notes").status_code == 404:  # run alone
            assert http.post("/v1/collections", json={"name": "team-notes"}).status_code == 201
        token = http.post("/v1/keys", json={"role": "read", "collections": ["team-notes"]}).json()["key"]
        before = http.get("/v1/documents", params={"collection": "team-notes"}).json()["total"]
    context, page = open_page(browser, server, token)
    try:
        assert page.locator("#kb-select option").all_inner_texts() == ["team-notes"]  # its own, nothing else
        page.wait_for_selector("#read-only:not([hidden])")
        assert page.is_disabled("#file-input") and "disabled" in page.get_attribute("#dropzone", "class")
        assert all(not b.is_visible() for b in page.locator("#doc-list button.delete").all())
        drop_file(page, "planted.txt", b"Planted by a reader.")
        page.wait_for_selector("#uploads li.failed")
        assert "may not upload into team-notes" in page.inner_text("#uploads li.failed")
        # past the page, the server itself refuses the reader's upload
        status = page.evaluate(
            """async (token) => {
                const form = new FormData();
                form.append("files", new File(["Planted."], "planted.txt", { type: "text/plain" }));
                form.append("collection", "team-notes");
                const response = await fetch("/v1/documents/files", { method: "POST", body: form,
                                                                        headers: { Authorization: `Bearer ${token}` } });
                return response.status;
            }""", token)
        assert status == 403
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as http:
            assert http.get("/v1/documents", params={"collection": "team-notes"}).json()["total"] == before
    finally:
        context.close()
