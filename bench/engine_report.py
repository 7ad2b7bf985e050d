"""The engine bench's summary (medians over questions, fidelity means) and its table."""

from __future__ import annotations

import platform

import torch

from bench.metrics import safe_mean, safe_median
from blend_engine.types import PrefillMode


def summarize(runs, variants, args, engine, is_quality: bool) -> dict:
    full_ttft = safe_median(r.ttft_ms for r in runs.records["full"])
    reuse_kl = {v.sink: safe_mean(r.tf_kl for r in runs.records[v.label] if r.tf_kl is not None)
                for v in variants if v.mode == PrefillMode.REUSE}
    rows = {}
    for v in variants:
        recs = runs.records[v.label]
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
            "sink": v.sink.value,
            "median_ttft_ms": ttft,
            "speedup_vs_full": full_ttft / ttft if ttft else None,
            "median_tokens_recomputed": safe_median(r.num_recomputed for r in recs),
            "first_token_agreement": safe_mean(float(r.first_token_agrees) for r in recs),
            "tf_agreement": safe_mean(r.tf_agreement for r in recs if r.tf_agreement is not None),
            "tf_kl_mean": kl,
            "kl_vs_reuse": (kl / ref_kl) if (kl is not None and ref_kl) else None,
            "f1_vs_full": safe_mean(r.f1_vs_full for r in recs if r.f1_vs_full is not None),
            "f1_vs_gold": safe_mean(r.f1_vs_gold for r in recs if r.f1_vs_gold is not None),
        }
    return {
        "bench": "engine",
        "model": engine.model_name,
        "is_quality_meaningful": is_quality,
        "device": str(engine.device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "questions": args.questions,
        "passages": args.passages,
        "median_prompt_tokens": safe_median(r.num_prompt for r in runs.records["full"]),
        "results": rows,
    }


def print_table(summary: dict) -> None:
    print(f"\nmodel {summary['model']} on {summary['device']} ({summary['dtype']}), "
          f"{summary['questions']} questions x {summary['passages']} passages, "
          f"median prompt {summary['median_prompt_tokens']} tokens")
    width = max(28, *(len(label) + 1 for label in summary["results"]))
    header = f"{'variant':<{width}}{'TTFT ms':>9}{'speedup':>9}{'recomp':>8}{'1st tok':>8}{'TF agr':>8}" \
             f"{'TF KL':>8}{'KL/reuse':>9}{'F1 full':>8}{'F1 gold':>8}"
    print(header)
    print("-" * len(header))
    for label, row in summary["results"].items():
        print(f"{label:<{width}}{_f(row['median_ttft_ms'], 0):>9}{_f(row['speedup_vs_full'], 2):>9}"
              f"{_f(row['median_tokens_recomputed'], 0):>8}{_f(row['first_token_agreement'], 2):>8}"
              f"{_f(row['tf_agreement'], 3):>8}{_f(row['tf_kl_mean'], 3):>8}{_f(row['kl_vs_reuse'], 2):>9}"
              f"{_f(row['f1_vs_full'], 2):>8}{_f(row['f1_vs_gold'], 2):>8}")
    decode = summary.get("decode")
    if decode:
        graph = "CUDA graph" if decode["is_cuda_graph"] else "eager"
        print(f"decode over {decode['num_tokens']} tokens at ~{_f(decode['median_context_tokens'], 0)} tokens of context: "
              f"engine ({graph}) {_f(decode['engine_ms_per_token'], 2)} ms/token, "
              f"HF eager {_f(decode['hf_eager_ms_per_token'], 2)} ms/token")
    if not summary["is_quality_meaningful"]:
        print("(random weights: quality columns are meaningless and left empty)")


def _f(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
