"""`ragblend bench corpus` end to end on tiny inputs: table, then JSON."""

import argparse
import json

from bench.store import corpus as corpus_bench


def test_bench_corpus_prints_a_row_per_budget_then_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    corpus_bench.add_arguments(parser)
    args = parser.parse_args(["--documents", "12", "--doc-tokens", "64", "--chunk-tokens", "32", "--questions", "60",
                              "--ttft-model", "random:tiny-llama", "--ttft-repeats", "1",
                              "--out", str(tmp_path / "out.json")])
    assert corpus_bench.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == summary
    rows = {r["budget"]: r for r in summary["rows"]}
    assert set(rows) == {"10%", "30%", "100%"} and summary["chunks"] == 24
    assert rows["100%"]["hit_rate"] == 1.0 and rows["100%"]["mean_ttft_vs_full_budget"] == 1.0
    for share in ("10%", "30%"):  # the tier stays within its budget; some chunks come back on use
        assert rows[share]["bytes_on_disk"] <= rows[share]["budget_bytes"]
        assert 0 < rows[share]["hit_rate"] < 1 and rows[share]["admitted"] > rows[share]["chunks_precomputed"]
    assert len(summary["ttft_ms_by_missing_chunks"]) == 3  # 0, 1 or 2 of a document's chunks missing
    # through the server's executor, mode auto: every chunk missing is a full prefill
    plans = summary["ttft"]["plans_by_missing_chunks"]
    assert summary["ttft"]["mode"] == "auto" and len(plans) == 3 and plans[-1] == "full"
