"""`ragblend bench attention-dtype` on the tiny random model: both attention dtypes, full and blend, every
question in the JSON, the ratios computed from those rows."""

from __future__ import annotations

import json
from statistics import median

from app.cli import main
from tests.test_server_bench import TINY_MODEL, dataset


def test_bench_attention_dtype_runs_both_dtypes_side_by_side(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(f"model: {json.dumps(TINY_MODEL)}\n")
    code = main(["bench", "attention-dtype", "--config", str(config), "--data", dataset(tmp_path / "data.json"),
                 "--first-question", "0", "--questions", "2", "--passages", "2", "--answer-tokens", "3",
                 "--out", str(tmp_path / "out.json")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "out.json").read_text())
    assert summary["bench"] == "attention-dtype" and summary["questions"] == 2
    rows = summary["rows"]
    assert sorted(rows) == ["blend, attention bfloat16", "blend, attention model", "full, attention bfloat16",
                            "full, attention model"]
    assert all(len(r["ttft_ms"]) == 2 and r["ttft_p50_ms"] > 0 for r in rows.values())
    full, bf16 = rows["full, attention model"]["ttft_ms"], rows["full, attention bfloat16"]["ttft_ms"]
    assert summary["bf16_speedup"]["full"] == median(a / b for a, b in zip(full, bf16))
    assert rows["full, attention model"]["speedup_vs_full_model"] == 1.0
    # fidelity against the float32 engine's own full prefill: none from itself, some from bf16 and from blend
    assert rows["full, attention model"]["tf_kl_mean"] == 0.0 and rows["full, attention model"]["tf_agreement"] == 1.0
    # bf16 changed the logits (a random model's are near uniform: its KL is ~1e-7, either side of 0 in float32)
    assert rows["full, attention bfloat16"]["tf_kl_mean"] != 0.0 and rows["blend, attention model"]["tf_kl_mean"] > 0
