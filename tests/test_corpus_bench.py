"""`ragblend bench corpus` and `ragblend bench kv-codec` end to end on tiny inputs: table, then JSON."""

import argparse
import json

from bench.store import codec as kv_codec_bench, corpus as corpus_bench


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


def test_bench_kv_codec_rows_per_format(tmp_path, capsys):
    words = "the river flows past an old mill near the town of harlow where people trade wool".split()
    item = {"question": "where is it?", "answers": ["harlow"],
            "ctxs": [{"title": "", "text": " ".join(words[i:] + words[:i]) * 3} for i in range(2)]}
    data = tmp_path / "data.json"
    data.write_text(json.dumps([item]))
    parser = argparse.ArgumentParser()
    kv_codec_bench.add_arguments(parser)
    args = parser.parse_args(["--data", str(data), "--questions", "1", "--passages", "2",
                              "--model", "random:tiny-llama", "--answer-tokens", "4"])
    assert kv_codec_bench.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["format"]: r for r in summary["rows"]}
    assert rows["float16"]["vs_float16"] == 1.0 and rows["int8"]["vs_float16"] < 0.55
    assert rows["int4"]["is_shipped"] and rows["int4"]["vs_float16"] < 0.45  # random KV: incompressible codes
