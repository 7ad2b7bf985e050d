"""`ragblend bench replicas` end to end on a tiny random model: SQLite and Postgres side by side, the
propagation to a second replica's index measured for every document."""

from __future__ import annotations

import json

from app.cli import main
from tests.test_server_bench import dataset


def test_bench_replicas_asks_both_stores_and_times_propagation(postgres, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text('model: {"name": "random:tiny-llama", "device": "cpu"}\n')
    code = main(["bench", "replicas", "--database-url", postgres.new_database(), "--config", str(config),
                 "--data", dataset(tmp_path / "data.json", 2), "--questions", "2", "--passages", "2",
                 "--rounds", "1", "--top-k", "2", "--max-tokens", "2", "--out", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == summary
    assert set(summary["results"]) == {"sqlite", "pg"} and summary["propagation_ms"]["num"] == 4
    assert all(row["median_e2e_ttft_ms"] > 0 and row["ingest_docs_per_s"] > 0 for row in summary["results"].values())
    assert 0 <= summary["propagation_ms"]["p50"] <= summary["propagation_ms"]["max"]
