"""`ragblend bench memory` end to end on a tiny random model: the stages in a fresh interpreter, a
`ragblend serve` child read ready, idle, after an upload and a question, and idle again; the JSON
and the tables. (The real model's idle server against its bounds: tests/test_server_memory.py.)"""

from __future__ import annotations

import json

from app.cli import main
from bench.serving.memory_stages import STAGES

TINY_CONFIG = 'model: {"name": "random:tiny-llama", "device": "cpu"}\nscheduler: {"idle_release_s": 1}\n'


def test_bench_memory_reads_every_stage_and_the_idle_server(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--config", str(config), "--questions", "1", "--idle-s", "3",
                 "--max-tokens", "4", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    stages = summary["stages"]
    assert [row["stage"] for row in stages["stages"]] == list(STAGES)
    for row in stages["stages"]:
        assert 0 < row["rss_mb"] <= row["peak_mb"] and abs(row["anon_mb"] + row["file_mb"] + row["shmem_mb"]
                                                          - row["rss_mb"]) < 1
    rss = {row["stage"]: row["rss_mb"] for row in stages["stages"]}
    assert rss["import torch"] > rss["interpreter"] + 50  # torch's libraries are read
    assert stages["weights_mb"] == {} or all(v >= 1 for v in stages["weights_mb"].values())
    assert stages["kv_bytes_per_token"] > 0 and any(".so" in name for name in stages["mappings_mb"])
    server = summary["server"]
    labels = [row["label"] for row in server["readings"]]
    assert labels == ["ready", "ready, idle", "after the questions", "after the questions, idle"]
    for row in server["readings"]:
        assert abs(row["own_mb"] - (row["rss_mb"] - row["memory_tier_mb"] - row["prefix_cache_mb"])) < 0.2
    assert len(server["run"]["questions"]) == 1 and len(server["run"]["ttft_ms"]) == 1
    printed = capsys.readouterr().out
    assert "| planner measurement |" in printed and "| after the questions, idle |" in printed
    assert json.loads(printed.strip().splitlines()[-1]) == summary
