"""`ragblend ingest` and `ask` as a user meets them: ids from relative paths, empty files skipped,
one line per problem naming the file (and line), no tracebacks, distinct exit codes."""

from __future__ import annotations

import json

import pytest

from app.cli import main
from app.commands.exit_codes import ExitCode
from app.commands.ingest_files import collect, document_id
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
    assert document_id(docs / "b" / "my notes.md", docs) == "b:my-notes"
    assert document_id(docs / "a" / "notes.txt", docs / "a" / "notes.txt") == "notes"
    collected = collect([docs])
    assert sorted(d["id"] for d in collected.documents) == ["a:notes", "b:my-notes", "b:notes"]
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
