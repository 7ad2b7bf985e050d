"""`ragblend bench collections` on tiny inputs: it runs, both layouts' figures come out, and the JSON
is written where asked (decision 0019's figures come from it at full size)."""

from __future__ import annotations

import json

from app.cli import main


def test_the_collections_bench_runs_small_and_writes_its_summary(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "collections", "--collections", "4", "--chunks", "30", "--queries", "10",
                 "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads(out.read_text())
    assert (summary["collections"], summary["chunks_per_collection"], summary["dim"]) == (4, 30, 384)
    for way in ("filtered_1", "sharded_1", "filtered_3", "sharded_3"):
        assert 0 < summary[way]["p50_ms"] <= summary[way]["p99_ms"]
