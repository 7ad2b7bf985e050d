"""`python -m bench.attention_dtype_server` on the tiny random model: two `ragblend serve` children (as
configured, and with the attention in the model's dtype) in turn, a row per prompt length and mode."""

from __future__ import annotations

import json

from bench.attention_dtype_server import main
from tests.test_server_bench import TINY_MODEL, dataset


def test_both_servers_answer_every_length_in_turn(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {json.dumps(TINY_MODEL)}\n")
    code = main(["--config", str(config), "--data", dataset(tmp_path / "data.json"), "--first-question", "0",
                 "--questions", "2", "--passages-list", "1,2", "--modes", "blend", "--out", str(tmp_path / "o.json")])
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "o.json").read_text())
    rows = summary["rows"]
    assert [(r["mode"], r["passages"]) for r in rows] == [("blend", 1), ("blend", 2)]
    assert rows[0]["prompt_tokens_p50"] < rows[1]["prompt_tokens_p50"]  # two passages make the longer prompt
    for row in rows:
        assert all(len(row["turns"][side]) == 2 for side in ("configured", "model"))
        assert row["prefill_model_over_configured"] > 0 and row["prefill_ms_p50"]["model"] > 0
