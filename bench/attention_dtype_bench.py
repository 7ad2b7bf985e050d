"""`ragblend bench attention-dtype`: a prefill's attention in the model's dtype against bf16, side by side.

Two engines of the same settings, one with `model.attention_dtype: model` (float32 on CPU) and one with
`bfloat16`, each with its own chunks' KV (precomputed as ingestion would, in its own attention dtype).
Per question, both engines run a full and a blend prefill, taking turns (who goes first alternates from
question to question, so drift hits both). Fidelity is against the float32 engine's full prefill:
teacher-forced KL(full, float32 || row) over its greedy answer (`--answer-tokens`), the same measure as
`ragblend bench engine`'s, and top-1 agreement with that answer. Prints a table and one JSON object
(also written to `--out`).
"""

from __future__ import annotations

import argparse
import platform
from dataclasses import replace
from statistics import median

import torch

from bench.harness.data import DEFAULT_DATA
from bench.harness.engine import greedy_ids, model_overrides, prompt_for, timed_prefill
from bench.engine_variants import Variant
from bench.harness.fidelity import argmax_agreement, mean_kl
from bench.harness.stats import safe_mean, safe_median
from bench.harness.data import load_questions
from bench.harness.output import cpu_name, emit_summary
from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode
from configs.settings import load_settings

DTYPES = ("model", "bfloat16")
MODES = ("full", "blend")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=DEFAULT_DATA, help="MuSiQue-style JSON (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=10, help="questions (default: %(default)s)")
    parser.add_argument("--first-question", type=int, default=20,
                        help="the first question used (default: %(default)s, past bench engine's tuning set)")
    parser.add_argument("--passages", type=int, default=5, help="passages per question (default: %(default)s)")
    parser.add_argument("--ratio", type=float, default=None, help="blend's recompute ratio (default: the config's)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="tokens of the reference answer (KL)")
    parser.add_argument("--model", default=None, help="smollm2, a HF dir, a .gguf, or random:<shape>[:layers]")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--weights", default=None, help="linear layers' weight format (model.weights)")
    parser.add_argument("--config", default=None, help="a YAML config file")
    parser.add_argument("--out", default=None, help="also write the JSON summary here")


def run(args: argparse.Namespace) -> int:
    settings = load_settings(args.config, model=model_overrides(args))
    engines = {d: BlendEngine.from_config(replace(settings.model, attention_dtype=d), settings.blend) for d in DTYPES}
    sink = settings.blend.sink
    ratio = args.ratio if args.ratio is not None else settings.blend.recompute_ratio
    variants = {"full": Variant("full", PrefillMode.FULL, sink),
                "blend": Variant(f"blend@{ratio:.2f}", PrefillMode.BLEND, sink,
                                 replace(engines["model"].blend, recompute_ratio=ratio))}
    questions = load_questions(args.data, args.first_question + args.questions, args.passages)[args.first_question:]
    caches: dict[str, list[dict]] = {d: [{} for _ in questions] for d in DTYPES}
    for d in DTYPES:  # warm-up: the first prefill of each engine pays one-time costs
        for mode in MODES:
            timed_prefill(engines[d], prompt_for(engines[d], questions[0], sink, caches[d][0]), variants[mode], 1)
    rows: dict[tuple[str, str], list[dict]] = {(d, m): [] for d in DTYPES for m in MODES}
    for qi, question in enumerate(questions):
        order = DTYPES if qi % 2 == 0 else DTYPES[::-1]
        results = {}
        for d in order:
            segments = prompt_for(engines[d], question, sink, caches[d][qi])
            for mode in MODES:
                result, ms, _ = timed_prefill(engines[d], segments, variants[mode], args.answer_tokens)
                results[d, mode] = result
                rows[d, mode].append({"ttft_ms": ms, "prompt_tokens": len(result.token_ids)})
        reference = engines["model"]
        ref_ids = greedy_ids(reference, results["model", "full"], args.answer_tokens) if reference.tokenizer else []
        if ref_ids:
            ref_logits = reference.score(results["model", "full"], ref_ids)
            for (d, mode), result in results.items():
                logits = engines[d].score(result, ref_ids)
                rows[d, mode][-1].update(tf_kl=mean_kl(ref_logits, logits),
                                         tf_agreement=argmax_agreement(logits, ref_ids))
        print(f"question {qi + 1}/{len(questions)} done", flush=True)
    summary = _summary(rows, args, ratio, engines["model"])
    _print(summary)
    emit_summary(summary, args.out)
    return 0


def _summary(rows: dict[tuple[str, str], list[dict]], args: argparse.Namespace, ratio: float,
             engine: BlendEngine) -> dict:
    def ttfts(d: str, m: str) -> list[float]:
        return [r["ttft_ms"] for r in rows[d, m]]

    out_rows = {}
    for (d, m), records in rows.items():
        out_rows[f"{m}, attention {d}"] = {
            "attention_dtype": d, "mode": m, "ttft_ms": ttfts(d, m), "ttft_p50_ms": safe_median(ttfts(d, m)),
            "speedup_vs_full_model": median(a / b for a, b in zip(ttfts("model", "full"), ttfts(d, m))),
            "tf_kl_mean": safe_mean(r["tf_kl"] for r in records if "tf_kl" in r),
            "tf_agreement": safe_mean(r["tf_agreement"] for r in records if "tf_agreement" in r),
        }
    ratios = {m: median(a / b for a, b in zip(ttfts("model", m), ttfts("bfloat16", m))) for m in MODES}
    blend_over_full = {d: median(f / b for f, b in zip(ttfts(d, "full"), ttfts(d, "blend"))) for d in DTYPES}
    return {
        "bench": "attention-dtype", "model": engine.model_name, "weights": engine.weights.value,
        "device": str(engine.device), "machine": platform.machine(), "processor": cpu_name(),
        "threads": torch.get_num_threads(), "questions": len(rows["model", "full"]),
        "first_question": args.first_question, "passages": args.passages, "recompute_ratio": ratio,
        "prompt_tokens_p50": safe_median(r["prompt_tokens"] for r in rows["model", "full"]),
        "rows": out_rows,
        "bf16_speedup": ratios,  # per mode: median over questions of TTFT(model) / TTFT(bf16)
        "blend_over_full": blend_over_full,  # per attention dtype: median of full's TTFT / blend's
    }


def _print(summary: dict) -> None:
    print(f"{summary['questions']} questions, ~{summary['prompt_tokens_p50']:.0f} prompt tokens, "
          f"r={summary['recompute_ratio']}, {summary['weights']} weights, {summary['processor'] or summary['machine']}")
    print(f"{'row':<28} {'TTFT p50 ms':>12} {'vs full (model)':>16} {'TF KL':>8} {'TF agree':>9}")
    for name, row in summary["rows"].items():
        kl = "-" if row["tf_kl_mean"] is None else f"{row['tf_kl_mean']:.4f}"
        agree = "-" if row["tf_agreement"] is None else f"{row['tf_agreement']:.3f}"
        print(f"{name:<28} {row['ttft_p50_ms']:>12.0f} {row['speedup_vs_full_model']:>15.2f}x {kl:>8} {agree:>9}")
    print("bf16 attention's speedup per mode: " + ", ".join(f"{m} {v:.2f}x" for m, v in summary["bf16_speedup"].items())
          + "; blend over full: " + ", ".join(f"{d} {v:.2f}x" for d, v in summary["blend_over_full"].items()))
