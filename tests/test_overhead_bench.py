"""`ragblend bench overhead` end to end on the tiny random model: a `ragblend serve` child and an engine in
this process take turns over the same prompts; the JSON has both sides' TTFT on every question and round,
the server's breakdown, the ratios and the decode part."""

from __future__ import annotations

import json

from app.cli import main
from tests.test_server_bench import TINY_MODEL, dataset


def test_bench_overhead_times_the_server_and_the_engine_on_the_same_prompts(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {json.dumps(TINY_MODEL)}\n")
    code = main(["bench", "overhead", "--config", str(config), "--data", dataset(tmp_path / "data.json"),
                 "--first-question", "0", "--questions", "2", "--passages", "2", "--rounds", "2",
                 "--decode-tokens", "3", "--out", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "out.json").read_text())
    assert summary["prompt_tokens_match"] is True  # the server prefilled the engine's prompts
    for side in ("engine", "server"):
        assert sorted((r["round"], r["question"]) for r in summary["rows"][side]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # who goes first alternates by question and round
    assert [r["first"] for r in summary["rows"]["engine"]] == [True, False, False, True]
    assert all(r["mode"] == "blend" for r in summary["rows"]["server"])
    ratio = summary["ttft_server_over_engine"]
    assert len(ratio["values"]) == 4 and ratio["min"] <= ratio["median"] <= ratio["max"] and ratio["min"] > 0
    assert set(summary["server_breakdown_ms"]) == {"queue_ms", "retrieval_ms", "kv_load_ms", "prefill_ms",
                                                   "after_prefill_ms", "http_sse_ms"}
    decode = summary["decode"]
    assert len(decode["rows"]["engine"]) == len(decode["rows"]["server"]) == 2
    assert decode["engine_tokens_per_s"] > 0 and decode["server_tokens_per_s"] > 0
    assert "server/engine" in captured.out
