"""The prefetch-priority bench runs end to end on a tiny random model: its rows and its JSON."""

import argparse
import json

from bench.prefetch_priority_bench import add_arguments, run


def test_the_prefetch_priority_bench_times_each_priority_and_writes_its_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "prefetch.json"
    args = parser.parse_args(["--model", "random:tiny-llama", "--chunks", "2", "--prefetched", "3",
                              "--chunk-tokens", "32", "--rounds", "2", "--threads", "1", "--out", str(out)])
    assert run(args) == 0
    summary = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == summary
    assert [r["config"] for r in summary["rows"]] == [
        "blend alone", "blend beside a prefetch at normal priority", "blend beside a prefetch at idle priority"]
    assert all(len(v) == 2 and min(v) > 0 for v in summary["times_ms"].values())
