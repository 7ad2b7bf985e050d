"""POST /v1/documents/files over real HTTP (real SmolLM2 and MiniLM): every format in one request,
PDF chunks' pages, a cited answer from a PDF, each bad file a 4xx naming it with nothing ingested,
the size limits, the key, and `ragblend ingest` of PDF/HTML/DOCX files."""

from __future__ import annotations

import socket

import httpx
import pytest

from app.extract.dispatch import document_id
from app.testing import LiveServer
from configs.settings import load_settings
from tests.docgen import encrypt_pdf, make_docx, make_pdf, make_zip_bomb_docx

pytestmark = pytest.mark.smollm2

API_KEY = "upload-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
FILLER = [f"Filler sentence number {i} talks about nothing in particular at all." for i in range(12)]
VAULT_ID = document_id("vault report.pdf")  # a space in the name: the id is tagged with its hash
PDF = make_pdf([FILLER, ["The secret code of the green vault is 7391."] + FILLER, FILLER], title="Vault Report")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = load_settings(
        data_dir=tmp_path_factory.mktemp("upload"), server={"api_key": API_KEY},
        retrieval={"chunk_tokens": 64, "chunk_overlap": 8}, generation={"max_tokens": 8},
        limits={"max_upload_bytes": 300_000, "max_unzipped_bytes": 4_000_000, "max_document_chars": 20_000},
    )
    with LiveServer(settings) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=300) as http:
        yield http


def upload(client, *files: tuple[str, bytes], **form) -> httpx.Response:
    return client.post("/v1/documents/files", files=[("files", (name, data)) for name, data in files], data=form)


def assert_refused(client, files, status: int, name: str, fragment: str) -> None:
    response = upload(client, ("innocent.txt", b"This file alone would be fine."), *files)
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert name in message and fragment.lower() in message.lower(), message
    assert client.get("/v1/documents/innocent.txt").status_code == 404  # nothing half-ingested


def test_every_format_in_one_upload(client):
    files = [
        ("vault report.pdf", PDF),
        ("bridges.html", b"<title>Bridges</title><h1>Bridges</h1><p>The red bridge in Lisbon was painted in 1966.</p>"),
        ("handbook.docx", make_docx("Handbook", "Holidays", ["Staff get 25 days of holiday."])),
        ("owls.md", b"# Owls\n\nThe snowy owl of the north tower is called Hedwig."),
        ("fox.txt", b"The red fox sleeps in the barn."),
        ("more.jsonl", b'{"id": "cheese", "title": "Cheese", "text": "The cheese festival is in October."}\n'),
    ]
    response = upload(client, *files)
    assert response.status_code == 201, response.text
    docs = {d["id"]: d for d in response.json()["documents"]}
    assert {k: (d["title"], d["format"]) for k, d in docs.items()} == {
        VAULT_ID: ("Vault Report", "pdf"), "bridges.html": ("Bridges", "html"),
        "handbook.docx": ("Handbook", "docx"), "owls.md": ("Owls", "markdown"), "fox.txt": ("The red fox sleeps in the barn.", "text"),
        "cheese": ("Cheese", "jsonl"),
    }
    assert docs[VAULT_ID]["num_pages"] == 3 and len(docs[VAULT_ID]["chunks"]) > 3
    assert all(c["kv_cached"] for d in docs.values() for c in d["chunks"])


def test_pdf_chunks_know_their_page(client):
    detail = client.get(f"/v1/documents/{VAULT_ID}").json()
    pages = detail["metadata"]["chunk_pages"]
    assert len(pages) == len(detail["chunks"]) and pages == sorted(pages) and set(pages) == {1, 2, 3}
    assert detail["metadata"]["num_pages"] == 3 and detail["metadata"]["source"] == "vault report.pdf"
    code_chunk = next(c for c in detail["chunks"] if "7391" in c["text"])
    assert pages[code_chunk["position"]] == 2


def test_a_question_about_the_pdf_cites_it(client):
    response = client.post("/v1/query", json={"question": "What is the secret code of the green vault?", "top_k": 2,
                                              "max_tokens": 8})
    assert response.status_code == 200, response.text
    sources = response.json()["sources"]
    assert any(s["document_id"] == VAULT_ID and "7391" in s["text"] for s in sources)


def test_reupload_replaces_and_form_options_apply(client):
    response = upload(client, ("fox.txt", b"The grey fox sleeps in the shed. It snores."), chunking="none", precompute="false")
    assert response.status_code == 201, response.text
    [chunk] = response.json()["documents"][0]["chunks"]
    assert chunk["kv_cached"] is False
    assert "grey fox" in client.get("/v1/documents/fox.txt").json()["chunks"][0]["text"]


@pytest.mark.parametrize(
    ("name", "data", "status", "fragment"),
    [
        ("locked.pdf", encrypt_pdf(make_pdf([["secret text"]])), 422, "encrypted"),
        ("broken.pdf", PDF[:400], 422, "not a readable pdf"),
        ("scan.pdf", make_pdf([[], []]), 422, "no extractable text"),
        ("bomb.docx", make_zip_bomb_docx(8 << 20), 413, "zip bomb"),
        ("photo.pdf", b"\x89PNG\r\n\x1a\n" + b"\0" * 64, 422, "not a pdf"),
        ("sneaky.txt", PDF, 422, "is the extension right"),
        ("tool.exe", b"MZ\x90\x00", 422, "unsupported file type"),
        ("long.txt", b"word " * 5000, 413, "limit is 20000"),
    ],
)
def test_bad_files_are_refused_by_name(client, name, data, status, fragment):
    assert_refused(client, [(name, data)], status, name, fragment)


def test_upload_limits_and_request_errors(server, client):
    response = upload(client, ("big.txt", b"x" * 310_000))
    assert response.status_code == 413 and "300000 bytes" in response.json()["error"]["message"]
    assert_refused(client, [("innocent.txt", b"twice")], 422, "innocent.txt", "rename one")
    assert client.post("/v1/documents/files", data={"chunking": "none"}).status_code == 422  # no files
    assert client.post("/v1/documents/files", files=[("files", ("a.txt", b"x"))], data={"chunking": "pages"}).status_code == 422
    with httpx.Client(base_url=server.url, timeout=30) as anonymous:
        assert anonymous.post("/v1/documents/files", files=[("files", ("a.txt", b"hi"))]).status_code == 401


def test_a_200_mb_upload_is_refused_before_it_is_read(server):
    head = (f"POST /v1/documents/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {API_KEY}\r\n"
            "Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 209715200\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head.encode() + b"--x\r\n")
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 413") and "exceeds the limit of 300000 bytes" in reply


def test_cli_ingest_sends_pdf_html_docx_to_the_upload_route(server, client, tmp_path, capsys):
    from app.cli import main

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "atlas.pdf").write_bytes(make_pdf([["The atlas shows 12 islands."]], title="Atlas"))
    (tmp_path / "docs" / "page.html").write_bytes(b"<title>Page</title><p>A page about kites.</p>")
    (tmp_path / "docs" / "memo.docx").write_bytes(make_docx("Memo", "Memo", ["The memo is short."]))
    (tmp_path / "docs" / "note.md").write_text("# Note\n\nA short note.")
    args = ["ingest", str(tmp_path / "docs"), "--url", server.url, "--api-key", API_KEY]
    assert main(args) == 0
    assert "ingested 4 documents" in capsys.readouterr().out
    assert client.get("/v1/documents/atlas.pdf").json()["metadata"]["chunk_pages"] == [1]
    (tmp_path / "docs" / "zz-locked.pdf").write_bytes(encrypt_pdf(make_pdf([["x"]])))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "zz-locked.pdf" in err and "encrypted" in err
    assert client.get("/v1/documents/zz-locked.pdf").status_code == 404
