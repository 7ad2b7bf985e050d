"""A weight format against a reference one (fp32), side by side on each question: prefill and decode speed, and
the format's own fidelity (teacher-forced KL of its full prefill against the reference's; docs/benchmarks/weights.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench.harness.engine import Variant, greedy_ids, measure_decode, prompt_for, timed_prefill
from bench.harness.output import fmt
from bench.harness.fidelity import argmax_agreement, mean_kl
from bench.harness.stats import safe_mean, safe_median
from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode
from configs.enums import SinkMode


@dataclass(frozen=True)
class FormatRecord:
    ref_prefill_ms: float
    prefill_ms: float
    num_prompt: int
    tf_kl: float | None
    decode_kl: float | None  # the same through the format's decoder (its decode cache, e.g. bf16)
    tf_agreement: float | None
    is_answer_same: bool | None
    ref_decode_ms: float | None
    decode_ms: float | None


def compare_formats(engine: BlendEngine, reference: BlendEngine, questions, sink: SinkMode, args) -> dict:
    """Medians over questions of the format's and the reference's figures, fidelity means."""
    records = [_question(engine, reference, q, sink, args, i) for i, q in enumerate(questions)]
    decode = [r for r in records if r.decode_ms is not None]
    ref_ms, ms = safe_median(r.ref_prefill_ms for r in records), safe_median(r.prefill_ms for r in records)
    num_prompt = safe_median(r.num_prompt for r in records)
    return {
        "weights": engine.weights.value,
        "reference_weights": reference.weights.value,
        "median_prompt_tokens": num_prompt,
        "reference_prefill_tokens_per_s": num_prompt * 1000 / ref_ms,
        "prefill_tokens_per_s": num_prompt * 1000 / ms,
        "reference_decode_tokens_per_s": _rate(safe_median(r.ref_decode_ms for r in decode)),
        "decode_tokens_per_s": _rate(safe_median(r.decode_ms for r in decode)),
        "decode_speedup": safe_median(r.ref_decode_ms / r.decode_ms for r in decode),
        "tf_kl_mean": safe_mean(r.tf_kl for r in records if r.tf_kl is not None),
        "decode_kl_mean": safe_mean(r.decode_kl for r in records if r.decode_kl is not None),
        "tf_agreement": safe_mean(r.tf_agreement for r in records if r.tf_agreement is not None),
        "answer_agreement": safe_mean(float(r.is_answer_same) for r in records if r.is_answer_same is not None),
    }


def _question(engine, reference, question, sink, args, index: int) -> FormatRecord:
    full = Variant("full", PrefillMode.FULL, sink)
    ref_segments, segments = prompt_for(reference, question, sink, {}), prompt_for(engine, question, sink, {})
    ref_result, ref_ms, _ = timed_prefill(reference, ref_segments, full, args.answer_tokens)
    result, ms, _ = timed_prefill(engine, segments, full, args.answer_tokens)
    kl = decode_kl = agreement = is_same = None
    if not engine.is_random:
        ref_ids = greedy_ids(reference, ref_result, args.answer_tokens)
        if ref_ids:
            logits = engine.score(result, ref_ids)
            ref_logits = reference.score(ref_result, ref_ids)
            kl, agreement = mean_kl(ref_logits, logits), argmax_agreement(logits, ref_ids)
            decode_kl = mean_kl(ref_logits, _decoder_logits(engine, result, ref_ids))
        is_same = greedy_ids(engine, result, args.answer_tokens) == ref_ids
    ref_decode_ms = decode_ms = None
    if index < args.decode_questions and args.decode_tokens > 0:
        ref_decode_ms = measure_decode(reference, ref_segments, args.decode_tokens, with_hf=False).engine_ms_per_token
        decode_ms = measure_decode(engine, segments, args.decode_tokens, with_hf=False).engine_ms_per_token
    return FormatRecord(ref_ms, ms, len(result.token_ids), kl, decode_kl, agreement, is_same, ref_decode_ms, decode_ms)


def _decoder_logits(engine: BlendEngine, result, target_ids: list[int]) -> torch.Tensor:
    """Teacher forcing through the serving path (`engine.decoder`): logits [T, vocab] predicting each target."""
    decoder = engine.decoder(result)
    return torch.stack([result.logits] + [decoder.step(t) for t in target_ids[:-1]])


def _rate(ms: float | None) -> float | None:
    return None if not ms else 1000 / ms


def print_formats(row: dict) -> None:
    print(f"weights {row['weights']} vs {row['reference_weights']} (same questions, side by side, "
          f"~{row['median_prompt_tokens']:.0f} prompt tokens): full prefill {row['prefill_tokens_per_s']:.0f} vs "
          f"{row['reference_prefill_tokens_per_s']:.0f} tok/s; decode {fmt(row['decode_tokens_per_s'])} vs "
          f"{fmt(row['reference_decode_tokens_per_s'])} tok/s (x{fmt(row['decode_speedup'], 2)}); "
          f"TF KL(ref || format) {fmt(row['tf_kl_mean'], 4)} (through the decoder {fmt(row.get('decode_kl_mean'), 4)}), TF agreement {fmt(row['tf_agreement'], 3)}, "
          f"greedy answers identical {fmt(row['answer_agreement'], 2)}")
