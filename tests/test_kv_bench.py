"""`ragblend bench kv` end to end on a tiny random model and synthetic passages: table, then JSON."""

import argparse
import json

import pytest

from bench.store import kv as kv_bench


def run_bench(tmp_path, capsys, sentence: str, *extra: str) -> list[str]:
    """The bench over 3 rotations of `sentence` (tiny-llama, one question): its stdout lines."""
    words = sentence.split()
    item = {"question": "where is it?", "answers": [words[-1]],
            "ctxs": [{"title": "", "text": " ".join(words[i:] + words[:i]) * 3} for i in range(3)]}
    data = tmp_path / "data.json"
    data.write_text(json.dumps([item, item]))
    parser = argparse.ArgumentParser()
    kv_bench.add_arguments(parser)
    args = parser.parse_args(["--data", str(data), "--questions", "1", "--passages", "3", "--repeats", "1",
                              "--model", "random:tiny-llama", *extra])
    assert kv_bench.run(args) == 0
    return capsys.readouterr().out.strip().splitlines()


def test_bench_kv_prints_table_then_json(tmp_path, capsys):
    lines = run_bench(tmp_path, capsys, "the river flows past an old mill near the town of harlow where people "
                      "trade wool", "--out", str(tmp_path / "out.json"))
    summary = json.loads(lines[-1])
    assert lines[0].startswith("config") and any(line.startswith("blend disk+pipe") for line in lines)
    assert json.loads((tmp_path / "out.json").read_text()) == summary
    assert summary["bench"] == "kv" and summary["passages"] == 3 and summary["bytes:disk"] > 0
    # fp16 in every tier: streamed logits equal the memory tier's exactly
    assert summary["disk+pipe:max_logit_diff"] == 0.0
    assert summary["top1_agreement_vs_memory_blend"]["disk+pipe"] == 1
    # the plan's ratio is at least the floor; what ran is round(ratio x cached) of the 75 cached tokens
    assert round(summary["min_recompute_ratio"] * 75) / 75 <= summary["auto_ratio"] <= 1.0


def test_bench_kv_throttled_disk_makes_the_planner_fall_back(tmp_path, capsys):
    lines = run_bench(tmp_path, capsys, "a slow disk makes loading cost more than computing the whole prompt "
                      "again", "--throttle-mbps", "disk=0.05")
    summary = json.loads(lines[-1])
    assert summary["throttle_mbps"] == {"disk": 0.05}
    # never blend from a disk this slow: full (nothing loaded, nothing waited for), or split where the
    # measured compute of the front chunks hides one rear chunk's load (which plan wins depends on
    # how fast this machine computes right now; timings are the bench's business, not a test's)
    plan = summary["plans"]["disk+pipe+auto"]
    assert plan in (["full"], ["split"]), plan
    if plan == ["full"]:
        assert summary["disk+pipe+auto:source_wait"] == 0


def test_bench_kv_variant_rows_beside_the_default(tmp_path, capsys):
    lines = run_bench(tmp_path, capsys, "the ferry leaves the harbour at dawn and returns with fish before noon",
                      "--variant", "recompute_ratio=0.5")
    summary = json.loads(lines[-1])
    # the variant's blend from memory and streamed from the int4 disk tier, each with its own timing
    for key in ("memory recompute_ratio=0.5", "disk-int4+pipe recompute_ratio=0.5",
                "disk-int4+pipe recompute_ratio=0.5:source_wait"):
        assert summary[key] >= 0, key
    assert any(line.startswith("recompute_ratio=0.5") for line in lines)


def test_bench_kv_refuses_a_bad_variant_before_any_work(tmp_path):
    parser = argparse.ArgumentParser()
    kv_bench.add_arguments(parser)
    args = parser.parse_args(["--data", str(tmp_path / "none.json"), "--model", "random:tiny-llama",
                              "--variant", "no_such_field=1"])
    with pytest.raises(ValueError, match="no_such_field"):  # before the data is read (there is none)
        kv_bench.run(args)
