"""`ragblend bench engine`: TTFT and fidelity to a full prefill per prefill mode and ratio, every row side by
side on each question, the chunks' KV precomputed in memory (docs/benchmarks/engine.md)."""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass

from bench.engine.report import print_table, summarize
from bench.engine.variants import main_variants, spec_variants
from bench.harness.args import add_data, add_model, add_out
from bench.harness.data import Question, load_questions
from bench.harness.engine import greedy_ids, load_engine, measure_decode, model_overrides, prompt_for, timed_prefill
from bench.harness.fidelity import argmax_agreement, best_f1, mean_kl, token_f1
from bench.harness.output import emit_summary
from bench.harness.stats import safe_median
from blend_engine.types import PrefillMode
from configs.enums import SinkMode


@dataclass
class Record:
    """One variant's figures on one question."""

    ttft_ms: float
    num_recomputed: int
    num_prompt: int
    first_token_agrees: bool
    recompute_ratio: float | None = None  # the ratio used (adaptive: chosen per question)
    tf_agreement: float | None = None
    tf_kl: float | None = None
    f1_vs_full: float | None = None
    f1_vs_gold: float | None = None
    answer: str = ""


Runs = dict[str, list[Record]]  # a variant's label -> its records, question by question


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data(parser, questions=20, first_question=0)
    add_model(parser)
    parser.add_argument("--config", default=None, help="a YAML config file")
    parser.add_argument("--ratios", default="0.05,0.15,0.30", help="blend recompute ratios")
    parser.add_argument("--sink", default=None, choices=[s.value for s in SinkMode])
    parser.add_argument("--variant", action="append", default=[],
                        help='a blend row at r=0.15 with these config fields, e.g. "selection=query check_layers=2" '
                             'or "is_ratio_adaptive=true adaptive_mass=0.5" (repeatable)')
    parser.add_argument("--no-prefix-row", action="store_true", help="skip the prefix-mode row (as slow as full)")
    parser.add_argument("--answer-tokens", type=int, default=32, help="max tokens of the reference answer")
    parser.add_argument("--no-answers", action="store_true",
                        help="skip each variant's free-running answer (F1 columns empty; teacher-forced ones kept)")
    parser.add_argument("--decode-tokens", type=int, default=64,
                        help="decode ms/token over this many tokens, engine vs HF eager (0: skip)")
    parser.add_argument("--decode-questions", type=int, default=3, help="questions the decode rows are measured on")
    add_out(parser)


def run(args: argparse.Namespace) -> int:
    settings, engine = load_engine(args.config, args.threads, **_overrides(args))
    questions = load_questions(args.data, args.questions, args.passages, args.first_question)
    if not questions:
        raise ValueError(f"no questions left after skipping {args.first_question}")
    variants = main_variants(engine.blend, settings.blend.sink, _ratios(args.ratios))
    variants += spec_variants(engine.blend, settings.blend.sink, args.variant)
    if args.no_prefix_row:
        variants = [v for v in variants if v.mode != PrefillMode.PREFIX]
    is_quality = not engine.is_random
    runs: Runs = defaultdict(list)
    _warm_up(engine, questions[0], variants)
    for i, question in enumerate(questions):
        t0 = time.perf_counter()
        bench_question(engine, question, variants, runs, args.answer_tokens, is_quality, not args.no_answers)
        print(f"question {i + 1}/{len(questions)} done in {time.perf_counter() - t0:.1f} s", flush=True)
    summary = summarize(runs, variants, args, engine, is_quality)
    summary["decode"] = _decode_rows(engine, questions, variants[0].sink, args)
    print_table(summary)
    emit_summary(summary, args.out)
    return 0


def _overrides(args) -> dict:
    return {"model": model_overrides(args), "blend": {"sink": args.sink} if args.sink else {}}


def _ratios(text: str) -> list[float]:
    ratios = [float(x) for x in text.split(",") if x.strip()]
    if not ratios or any(not 0 <= r <= 1 for r in ratios):
        raise ValueError(f"ratios must be numbers in [0, 1], got {text!r}")
    return ratios


def bench_question(engine, question: Question, variants, runs: Runs, answer_tokens: int, is_quality: bool,
                   is_answered: bool = True) -> None:
    chunk_cache: dict = {}
    full_variant = variants[0]
    segments = prompt_for(engine, question, full_variant.sink, chunk_cache)
    full, full_ms, full_first = timed_prefill(engine, segments, full_variant, answer_tokens)
    ref_ids = greedy_ids(engine, full, answer_tokens) if is_quality else []
    ref_text = engine.tokenizer.decode(ref_ids, skip_special_tokens=True) if is_quality else ""
    ref_logits = engine.score(full, ref_ids) if ref_ids else None
    for variant in variants:
        if variant is full_variant:
            result, ms, first = full, full_ms, full_first
        else:
            segments = prompt_for(engine, question, variant.sink, chunk_cache)
            result, ms, first = timed_prefill(engine, segments, variant, answer_tokens)
        stats = result.stats
        record = Record(ms, stats.num_recomputed_tokens, stats.num_prompt_tokens, first == full_first,
                        stats.recompute_ratio)
        if is_quality:
            _score(engine, result, record, ref_ids, ref_logits, ref_text, question, answer_tokens, is_answered)
        runs[variant.label].append(record)


def _score(engine, result, record: Record, ref_ids, ref_logits, ref_text, question, answer_tokens,
           is_answered: bool) -> None:
    if ref_ids:
        logits = engine.score(result, ref_ids)
        record.tf_agreement = argmax_agreement(logits, ref_ids)
        record.tf_kl = mean_kl(ref_logits, logits)
    if not is_answered:
        return
    answer = engine.tokenizer.decode(greedy_ids(engine, result, answer_tokens), skip_special_tokens=True)
    record.answer = answer
    record.f1_vs_full = token_f1(answer, ref_text)
    record.f1_vs_gold = best_f1(answer, question.answers)


def _decode_rows(engine, questions: list[Question], sink, args) -> dict | None:
    if args.decode_tokens <= 0:
        return None
    figures = [measure_decode(engine, prompt_for(engine, q, sink, {}), args.decode_tokens)
               for q in questions[: args.decode_questions]]
    engine_ms = safe_median(f.engine_ms_per_token for f in figures)
    hf_ms = safe_median(f.hf_ms_per_token for f in figures)
    return {
        "num_tokens": args.decode_tokens,
        "weights": engine.weights.value,  # HF eager runs the same converted modules
        "median_context_tokens": safe_median(f.context_tokens for f in figures),
        "engine_ms_per_token": engine_ms,
        "hf_eager_ms_per_token": hf_ms,
        "engine_tokens_per_s": 1000 / engine_ms,
        "hf_eager_tokens_per_s": 1000 / hf_ms,
        "is_cuda_graph": engine.is_decode_graphed,
    }


def _warm_up(engine, question: Question, variants) -> None:
    cache: dict = {}
    for variant in variants[:1] + variants[-1:]:
        engine.prefill(prompt_for(engine, question, variant.sink, cache), variant.mode, variant.blend)
