"""The engine bench's summary (medians over questions, fidelity means) and its table."""

from __future__ import annotations

import platform

import torch

from bench.harness.output import fmt, table
from bench.harness.stats import safe_mean, safe_median
from blend_engine.types import PrefillMode


def _is_cacheblend(variant) -> bool:
    """No scale on the reused tokens' keys or attention: CacheBlend's own reuse / blend."""
    return variant.blend is None or not variant.blend.is_reuse_scaled


def summarize(runs, variants, args, engine, is_quality: bool) -> dict:
    full_ttft = safe_median(r.ttft_ms for r in runs["full"])
    reuse_kl: dict = {}  # per sink, CacheBlend's reuse (no scale): the reference of every row's KL ratio
    for v in sorted((v for v in variants if v.mode == PrefillMode.REUSE), key=lambda v: not _is_cacheblend(v)):
        if v.sink not in reuse_kl:
            reuse_kl[v.sink] = safe_mean(r.tf_kl for r in runs[v.label] if r.tf_kl is not None)
    rows = {}
    for v in variants:
        recs = runs[v.label]
        ttft = safe_median(r.ttft_ms for r in recs)
        kl = safe_mean(r.tf_kl for r in recs if r.tf_kl is not None)
        ref_kl = reuse_kl.get(v.sink)
        rows[v.label] = {
            "mode": v.mode.value,
            "recompute_ratio": v.blend.recompute_ratio if v.blend else None,
            "check_layers": list(v.blend.check_layers) if v.blend else None,
            "deviation": v.blend.deviation.value if v.blend else None,
            "selection": v.blend.selection.value if v.blend else None,
            "chunk_start_tokens": v.blend.chunk_start_tokens if v.blend else None,
            "reused_key_scale": v.blend.reused_key_scale if v.blend else None,
            "reused_attention_scale": v.blend.reused_attention_scale if v.blend else None,
            "probe_layer": v.blend.probe_layer if v.blend else None,
            "probe_span": v.blend.probe_span if v.blend else None,
            "sink": v.sink.value,
            "median_ttft_ms": ttft,
            "speedup_vs_full": full_ttft / ttft if ttft else None,
            "median_tokens_recomputed": safe_median(r.num_recomputed for r in recs),
            "mean_recompute_ratio": safe_mean(r.recompute_ratio for r in recs if r.recompute_ratio is not None),
            "first_token_agreement": safe_mean(float(r.first_token_agrees) for r in recs),
            "tf_agreement": safe_mean(r.tf_agreement for r in recs if r.tf_agreement is not None),
            "tf_kl_mean": kl,
            "kl_vs_reuse": (kl / ref_kl) if (kl is not None and ref_kl) else None,
            "f1_vs_full": safe_mean(r.f1_vs_full for r in recs if r.f1_vs_full is not None),
            "f1_vs_gold": safe_mean(r.f1_vs_gold for r in recs if r.f1_vs_gold is not None),
            "tf_kl_per_question": [r.tf_kl for r in recs],  # paired comparisons between rows
        }
    return {
        "bench": "engine",
        "model": engine.model_name,
        "is_quality_meaningful": is_quality,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weights": engine.weights.value,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "questions": args.questions,
        "first_question": args.first_question,
        "passages": args.passages,
        "median_prompt_tokens": safe_median(r.num_prompt for r in runs["full"]),
        "results": rows,
    }


def print_table(summary: dict) -> None:
    print(f"\nmodel {summary['model']} on {summary['device']} ({summary['dtype']}, {summary['weights']} weights), "
          f"{summary['questions']} questions x {summary['passages']} passages, "
          f"median prompt {summary['median_prompt_tokens']} tokens")
    print(table(["variant", "TTFT ms", "speedup", "recomp", "1st tok", "TF agr", "TF KL", "KL/reuse", "F1 full",
                 "F1 gold"], ([label, fmt(row["median_ttft_ms"], 0), fmt(row["speedup_vs_full"], 2),
                              fmt(row["median_tokens_recomputed"], 0), fmt(row["first_token_agreement"], 2),
                              fmt(row["tf_agreement"], 3), fmt(row["tf_kl_mean"], 3), fmt(row["kl_vs_reuse"], 2),
                              fmt(row["f1_vs_full"], 2), fmt(row["f1_vs_gold"], 2)]
                             for label, row in summary["results"].items())))
    decode = summary.get("decode")
    if decode:
        graph = "CUDA graph" if decode["is_cuda_graph"] else "eager"
        print(f"decode over {decode['num_tokens']} tokens at ~{fmt(decode['median_context_tokens'], 0)} tokens of context: "
              f"engine ({graph}) {fmt(decode['engine_tokens_per_s'], 1)} tok/s "
              f"({fmt(decode['engine_ms_per_token'], 2)} ms/token), HF eager {fmt(decode['hf_eager_tokens_per_s'], 1)} tok/s "
              f"({fmt(decode['hf_eager_ms_per_token'], 2)} ms/token), {decode['weights']} weights both")
    if not summary["is_quality_meaningful"]:
        print("(random weights: quality columns are meaningless and left empty)")
