"""`ragblend bench retrieval` on a small SQLite store: each mode under each embedder runtime in turn, the
parts per runtime, the JSON as printed; a runtime that does not exist is a usage error."""

from __future__ import annotations

import json

from app.cli import main
from app.commands.exit_codes import ExitCode


def test_bench_retrieval_times_each_mode_under_each_embedder_runtime(tmp_path, capsys):
    code = main(["bench", "retrieval", "--chunks", "40", "--queries", "3", "--random-vectors", "--modes",
                 "dense,hybrid", "--embedder-runtimes", "torch,onnx", "--out", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == ExitCode.OK, captured.err
    summary = json.loads((tmp_path / "out.json").read_text())
    assert summary["embedder_runtimes"] == ["torch", "onnx"]
    [sqlite] = summary["results"]
    assert sqlite["store"] == "sqlite" and sqlite["num_chunks"] == 40
    names = ["dense/torch", "dense/onnx", "hybrid/torch", "hybrid/onnx"]
    assert sorted(sqlite["search"]) == sorted(names) and sorted(sqlite["search_after_embedding"]) == sorted(names)
    assert sorted(sqlite["search_checked"]) == sorted(names)  # as the server retrieves: with the checks' lookup
    assert sorted(sqlite["parts"]) == ["dense_index", "embed/onnx", "embed/torch", "lexical_store", "unmatched_words", "unmentioned_names"]
    assert all(row["n"] == 3 and row["p50_ms"] > 0 for row in [*sqlite["search"].values(), *sqlite["search_checked"].values()])
    assert "hybrid/onnx (checked)" in captured.out and "embed/onnx" in captured.out  # the table


def test_bench_retrieval_refuses_an_unknown_runtime(capsys):
    assert main(["bench", "retrieval", "--embedder-runtimes", "torch,tensorrt"]) == ExitCode.USAGE
    assert "--embedder-runtimes takes torch, onnx" in capsys.readouterr().err
