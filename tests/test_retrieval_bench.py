"""`ragblend bench retrieval` on a small SQLite store: each mode in turn, its parts, the JSON as printed;
bad sizes are a usage error."""

from __future__ import annotations

import json

from app.cli import main
from app.commands.exit_codes import ExitCode


def test_bench_retrieval_times_each_mode_and_its_parts(tmp_path, capsys):
    code = main(["bench", "retrieval", "--chunks", "40", "--queries", "3", "--random-vectors", "--modes",
                 "dense,hybrid", "--out", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == ExitCode.OK, captured.err
    summary = json.loads((tmp_path / "out.json").read_text())
    [sqlite] = summary["results"]
    assert sqlite["store"] == "sqlite" and sqlite["num_chunks"] == 40
    for kind in ("search", "search_after_embedding", "search_checked"):  # checked: as the server retrieves
        assert sorted(sqlite[kind]) == ["dense", "hybrid"]
    assert sorted(sqlite["parts"]) == ["dense_index", "embed", "lexical_store", "unmatched_words", "unmentioned_names"]
    assert all(row["n"] == 3 and 0 < row["p50_ms"] <= row["max_ms"]
               for row in [*sqlite["search"].values(), *sqlite["search_checked"].values()])
    assert "hybrid (checked)" in captured.out and "embed" in captured.out  # the table


def test_bench_retrieval_refuses_bad_sizes(capsys):
    assert main(["bench", "retrieval", "--chunks", "0"]) == ExitCode.USAGE
    assert "--chunks and --queries must be >= 1" in capsys.readouterr().err
