"""`ragblend ingest` and `ask` as a user meets them: ids from relative paths, empty files skipped,
one line per problem naming the file (and line), no tracebacks, distinct exit codes."""

from __future__ import annotations

import json
import os
import re

import httpx
import pytest

from app.cli import main
from app.commands.exit_codes import ExitCode
from app.commands.ingest_files import collect, document_id
from app.documents.protocol import DOCUMENT_ID_PATTERN
from app.testing import LiveServer, free_port
from configs.settings import load_settings


@pytest.fixture
def docs(tmp_path):
    root = tmp_path / "docs"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "notes.txt").write_text("# Alpha notes\nThe alpha vault code is 1.")
    (root / "b" / "notes.txt").write_text("The beta vault code is 2.")
    (root / "b" / "my notes.md").write_text("Gamma.")
    (root / "empty.txt").write_text(" \n\u200b\n")
    return root


def unreachable_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_ids_come_from_the_path_relative_to_the_argument(docs):
    assert document_id(docs / "a" / "notes.txt", docs) == "a:notes"
    my_notes = document_id(docs / "b" / "my notes.md", docs)  # lossy cleaning: tagged with the path's hash
    assert re.fullmatch(r"b:my-notes-[0-9a-f]{10}", my_notes)
    assert document_id(docs / "a" / "notes.txt", docs / "a" / "notes.txt") == "notes"
    collected = collect([docs])
    assert sorted(d["id"] for d in collected.documents) == sorted(["a:notes", "b:notes", my_notes])
    assert collected.errors == [] and collected.warnings == [f"{docs / 'empty.txt'}: empty, skipped"]
    assert next(d for d in collected.documents if d["id"] == "a:notes")["title"] == "Alpha notes"


def test_every_input_problem_is_one_line_naming_the_file(docs, tmp_path):
    (docs / "latin1.txt").write_bytes(b"caf\xe9")
    (docs / "lines.jsonl").write_text('{"id": "j1", "text": "one"}\n{"text": \n[1]\n{"text": ""}\n')
    collected = collect([docs, tmp_path / "missing"])
    assert sorted(collected.errors) == sorted([
        f"{docs / 'latin1.txt'}: not UTF-8 text (byte 0xe9 at offset 3)",
        f"{docs / 'lines.jsonl'}:2: invalid JSON: Expecting value (column 10)",
        f"{docs / 'lines.jsonl'}:3: each line must be an object with a string 'text'",
        f"{tmp_path / 'missing'}: no such file or directory",
    ])
    assert f"{docs / 'lines.jsonl'}:4: empty text, skipped" in collected.warnings
    assert all("\n" not in line for line in collected.errors + collected.warnings)


def test_two_arguments_with_the_same_file_name_collide_with_a_clear_error(docs):
    collected = collect([docs / "a", docs / "b"])
    assert collected.errors == [f"{docs / 'b' / 'notes.txt'}: document id 'notes' is also "
                                f"{docs / 'a' / 'notes.txt'}'s; rename one"]


def test_input_errors_exit_2_before_anything_is_sent(docs, tmp_path, capsys):
    code = main(["ingest", str(docs), str(tmp_path / "missing"), "--url", unreachable_url()])
    err = capsys.readouterr().err
    assert code == ExitCode.USAGE == 2 and "no such file or directory" in err and "Traceback" not in err
    (tmp_path / "blank.md").write_text("\x00\x00")
    assert main(["ingest", str(tmp_path / "blank.md"), "--url", unreachable_url()]) == ExitCode.USAGE
    assert "nothing to ingest" in capsys.readouterr().err


def test_a_server_that_is_down_is_one_line_and_exit_3(docs, capsys):
    url = unreachable_url()
    assert main(["ingest", str(docs), "--url", url]) == ExitCode.UNREACHABLE == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"ragblend ingest: cannot reach the server at {url}/v1/documents")
    assert main(["ask", "anything?", "--url", url]) == ExitCode.UNREACHABLE
    assert capsys.readouterr().err.startswith("ragblend ask: cannot reach the server")


def test_a_refused_batch_names_its_files_and_exits_1(docs, tmp_path, capsys):
    settings = load_settings(data_dir=tmp_path / "data", model={"name": str(tmp_path / "missing.gguf")})
    with LiveServer(settings, is_waiting=False) as server:  # never ready: every ingest is a 503
        code = main(["ingest", str(docs / "a"), "--url", server.url])
    err = capsys.readouterr().err
    assert code == ExitCode.FAILED == 1 and "Traceback" not in err
    assert f"error: batch of {docs / 'a' / 'notes.txt'}: HTTP 503 not_ready" in err
    assert "0 of 1 documents ingested before the error" in err


def test_jsonl_documents_keep_their_own_ids(tmp_path):
    lines = [{"id": "x1", "text": "first"}, {"text": "no id"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    assert collect([tmp_path]).documents == lines


def lossy_names(root):
    """Files whose names clean to the same characters: they must still be different documents."""
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "a" / "notes.html").write_text("<title>A</title><p>The alpha page is about kites.</p>")
    (root / "b" / "notes.html").write_text("<title>B</title><p>The beta page is about boats.</p>")
    (root / os.fsdecode(b"\xff\xfe.txt")).write_text("Not UTF-8 named, about owls.")
    (root / "   .txt").write_text("Blank named, about foxes.")
    (root / os.fsdecode(b"\xfe.html")).write_text("<p>Not UTF-8 named either, about eels.</p>")
    (root / "my notes.txt").write_text("Spaced, about cats.")
    (root / "my-notes.txt").write_text("Dashed, about dogs.")
    (root / ("x" * 140 + "1.html")).write_text("<p>Long name one, about bees.</p>")
    (root / ("x" * 140 + "2.html")).write_text("<p>Long name two, about ants.</p>")


def test_different_paths_never_share_an_id(tmp_path):
    lossy_names(tmp_path / "docs")
    collected = collect([tmp_path / "docs"])
    assert collected.errors == []
    ids = [d["id"] for d in collected.documents] + [u.doc_id for u in collected.uploads]
    assert len(ids) == len(set(ids)) == 9, ids
    assert all(re.fullmatch(DOCUMENT_ID_PATTERN, i) for i in ids), ids
    assert {"a:notes.html", "b:notes.html", "my-notes"} <= set(ids)
    assert sum(i.endswith(".html") and len(i) <= 128 for i in ids) == 5  # the cut keeps the extension


def test_two_names_left_with_one_id_are_an_error_naming_both(tmp_path):
    (tmp_path / "notes.txt").write_text("one")
    (tmp_path / "notes.md").write_text("two")
    (tmp_path / "r.pdf").write_bytes(b"%PDF-1.4")
    (tmp_path / "r.jsonl").write_text(json.dumps({"id": "r.pdf", "text": "three"}))
    errors = collect([tmp_path]).errors
    assert errors == [f"{tmp_path / 'notes.txt'}: document id 'notes' is also {tmp_path / 'notes.md'}'s; rename one",
                      f"{tmp_path / 'r.pdf'}: document id 'r.pdf' is also {tmp_path / 'r.jsonl'}:1's; rename one"]


def test_cli_ingest_stores_every_file_under_its_own_id(tmp_path, capsys):
    """Through a live server: two notes.html in different folders and names that clean alike are all kept."""
    lossy_names(tmp_path / "docs")
    settings = load_settings(data_dir=tmp_path / "data", model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"chunking": "none"})
    with LiveServer(settings) as server, httpx.Client(base_url=server.url, timeout=120) as http:
        assert main(["ingest", str(tmp_path / "docs"), "--url", server.url, "--no-precompute"]) == 0
        assert "ingested 9 documents" in capsys.readouterr().out
        stored = http.get("/v1/documents", params={"limit": 100}).json()
        assert stored["total"] == 9, stored
        texts = {doc["id"]: http.get(f"/v1/documents/{doc['id']}").json()["chunks"][0]["text"]
                 for doc in stored["documents"]}
        assert "kites" in texts["a:notes.html"] and "boats" in texts["b:notes.html"]
        assert texts["a:notes.html"] != texts["b:notes.html"]


def test_knowledge_bases_and_scoped_keys_from_the_command_line(tmp_path, capsys):
    """`ragblend collections` and `keys` with the server's key; `ingest --collection` (text and an HTML
    upload) and `ask --collection` with a scoped key; a revoked key is refused (exit 1)."""
    (tmp_path / "hr").mkdir()
    (tmp_path / "hr" / "leave.txt").write_text("Every employee gets thirty-one days of annual leave.")
    (tmp_path / "hr" / "payroll.html").write_text("<html><body><p>Payroll closes on the 25th.</p></body></html>")
    settings = load_settings(data_dir=tmp_path / "data", model={"name": "random:tiny-llama", "device": "cpu"},
                             retrieval={"chunking": "none"}, server={"api_key": "root"}, generation={"max_tokens": 1})
    with LiveServer(settings) as server:
        admin = ["--url", server.url, "--api-key", "root"]
        assert main(["collections", "create", "hr", "--description", "people", *admin]) == 0
        assert main(["keys", "create", "--role", "write", "--collection", "hr", "--token-only", *admin]) == 0
        token = capsys.readouterr().out.strip().splitlines()[-1]
        scoped = ["--url", server.url, "--api-key", token]
        assert main(["ingest", str(tmp_path / "hr"), "--collection", "hr", "--no-precompute", *scoped]) == 0
        assert "ingested 2 documents" in capsys.readouterr().out
        assert main(["collections", "list", *scoped]) == 0
        assert capsys.readouterr().out.startswith("hr  2 documents")  # the key sees its own collection only
        assert main(["ask", "How many days of annual leave?", "--collection", "hr", *scoped]) == 0
        out = capsys.readouterr().out
        assert "hr/leave#0" in out or "hr/payroll.html#0" in out
        assert main(["ask", "Anything?", "--collection", "default", *scoped]) == ExitCode.FAILED
        assert "collection not found: default" in capsys.readouterr().err
        assert main(["keys", "list", *scoped]) == ExitCode.FAILED  # only the server's key manages keys
        assert "403" in capsys.readouterr().err
        assert main(["keys", "list", *admin]) == 0
        key_id = capsys.readouterr().out.split()[0]
        assert main(["keys", "revoke", key_id, *admin]) == 0 and f"revoked {key_id}" in capsys.readouterr().out
        assert main(["ask", "Anything?", *scoped]) == ExitCode.FAILED
        assert "401" in capsys.readouterr().err
        assert main(["collections", "delete", "hr", *admin]) == 0
        assert "deleted collection hr: 2 documents" in capsys.readouterr().out
