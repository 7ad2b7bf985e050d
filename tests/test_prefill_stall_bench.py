"""The stall bench runs end to end on a tiny random model: every setting, its parts and its JSON."""

import argparse
import json

from bench.prefill_stall_bench import add_arguments, run


def test_the_stall_bench_measures_each_setting_and_writes_its_json(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "stall.json"
    args = parser.parse_args(["--model", "random:tiny-llama", "--chunks", "4", "--chunk-size", "40", "--rounds", "1",
                              "--chunk-tokens", "16", "--warm-tokens", "3", "--after-tokens", "2", "--out", str(out)])
    assert run(args) == 0
    figures = json.loads(out.read_text())
    summary = figures["summary"]
    assert figures["num_prompt_tokens"] > 4 * 40 and set(figures["rounds"]) == {"parts_16", "whole"}
    assert summary["num_parts"]["whole"] == 1 and summary["num_parts"]["parts_16"] > 1
    assert summary["max_gap_s"]["parts_16"] > 0 and "max_gap_ratio_parts_16_vs_whole" in summary
