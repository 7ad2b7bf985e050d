"""`ragblend bench server-modes`: TTFT, decode and fidelity per prefill mode one question at a time, then
requests/s per mode under concurrent clients, the modes alternated round by round
(docs/benchmarks/server.md#per-prefill-mode-ragblend-bench-server-modes)."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field
from statistics import mean, median

import httpx

from app.commands.exit_codes import ExitCode
from bench.harness.fidelity import best_f1, normalize_answer, token_f1
from bench.harness.args import add_data, add_out, add_server, headers
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary, fmt, refuse, table
from bench.serving.server import WARMUP_TOKENS, request_body, round_questions, run_round
from bench.harness.client import StreamedAnswer, ingest_ready, stream_query
from bench.harness.stats import in_turn, ratio, spread
from bench.serving.report import Round, level_stats


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server(parser)
    add_data(parser, questions=10)
    parser.add_argument("--modes", default="full,blend,reuse", help="comma-separated; full first (the reference)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8,
                        help="clients at once in a throughput round, each its own question (at most --questions)")
    parser.add_argument("--throughput-modes", default="full,blend",
                        help="comma-separated, alternated round by round; the ratios are over the first")
    parser.add_argument("--throughput-rounds", type=int, default=3, help="rounds of the throughput phase")
    parser.add_argument("--throughput-answers", choices=("fixed", "natural"), default="fixed",
                        help="fixed: every answer --max-tokens long (ignore_eos: both modes decode alike); "
                             "natural: each answer ends at the model's end of text, at most --max-tokens")
    add_out(parser)


@dataclass
class ModeRuns:
    samples: list[StreamedAnswer] = field(default_factory=list)
    f1_gold: list[float] = field(default_factory=list)
    f1_full: list[float] = field(default_factory=list)
    agrees: list[float] = field(default_factory=list)


async def ask(client: httpx.AsyncClient, questions: list[Question], qi: int, mode: str, max_tokens: int) -> StreamedAnswer:
    """Question `qi` over its passages in `mode`, the prefix cache off (every mode asks the same prompt, and
    each mode's prefill is measured), the answer ending at end of text."""
    return await stream_query(client, request_body(questions[qi], qi, round_args(mode, max_tokens, ignore_eos=False)))


async def latency_phase(client, questions: list[Question], modes: list[str], max_tokens: int) -> dict[str, ModeRuns]:
    runs = {mode: ModeRuns() for mode in modes}
    await ask(client, questions, 0, modes[-1], WARMUP_TOKENS)
    for qi, question in enumerate(questions):
        reference = None
        for mode in modes:
            sample = await ask(client, questions, qi, mode, max_tokens)
            reference = sample.answer if reference is None else reference
            run = runs[mode]
            run.samples.append(sample)
            run.f1_gold.append(best_f1(sample.answer, question.answers))
            run.f1_full.append(token_f1(sample.answer, reference))
            run.agrees.append(float(normalize_answer(sample.answer) == normalize_answer(reference)))
    return runs


def is_ignoring_eos(args: argparse.Namespace) -> bool:
    """`--throughput-answers fixed`: every answer runs to --max-tokens (the one place this is decided)."""
    return args.throughput_answers == "fixed"


def round_args(mode: str, max_tokens: int, ignore_eos: bool = True) -> argparse.Namespace:
    """What server_bench.run_round reads: answers in `mode`, every one `max_tokens` long (`ignore_eos`) or
    at most that, the chats at once, the prefix cache off (the rounds ask the same questions again, and every
    mode asks them)."""
    return argparse.Namespace(max_tokens=max_tokens, ignore_eos=ignore_eos, mode=mode, prefix_cache="off")


async def throughput_phase(client: httpx.AsyncClient, questions: list[Question], modes: list[str],
                           args: argparse.Namespace, is_warming_up: bool) -> tuple[dict[str, list[Round]], list[dict]]:
    """The throughput rounds, the modes in turn, and the order they ran in; `is_warming_up`: each question
    asked once per mode first (short answers, `--concurrency` at a time), as the latency phase would have."""
    if is_warming_up:
        for mode in modes:
            for start in range(0, len(questions), args.concurrency):
                indices = list(range(start, min(start + args.concurrency, len(questions))))
                await run_round(client, questions, indices, round_args(mode, WARMUP_TOKENS))
    rounds: dict[str, list[Round]] = {mode: [] for mode in modes}
    schedule = []
    for round_index in range(args.throughput_rounds):
        indices = round_questions(args.concurrency, round_index, len(questions))
        for mode in in_turn(modes, round_index):
            body_args = round_args(mode, args.max_tokens, ignore_eos=is_ignoring_eos(args))
            rounds[mode].append(await run_round(client, questions, indices, body_args))
            schedule.append({"round": round_index, "mode": mode, "questions": indices})
    return rounds, schedule


def answer_lengths(rounds: list[Round]) -> dict[str, float]:
    """Completion tokens per answer over the rounds: with natural answers the modes' decode work differs by
    what they answer, so it is reported beside their requests/s."""
    lengths = [c.answer.num_completion_tokens for r in rounds for c in r.chats if c.answer is not None]
    return {"mean": mean(lengths), "median": median(lengths), "max": max(lengths)} if lengths else {}


def throughput_summary(rounds: dict[str, list[Round]], schedule: list[dict], args: argparse.Namespace) -> dict | None:
    """Per mode its rounds' statistics (server_report.level_stats); per other mode, its requests/s over the
    first mode's round by round, and its TTFT p50/p95 over the first mode's."""
    if not rounds:
        return None
    rows = {mode: {**level_stats(mode_rounds), "completion_tokens_per_answer": answer_lengths(mode_rounds)}
            for mode, mode_rounds in rounds.items()}
    first, *others = rows
    vs_first = {}
    for mode in others:
        per_round = [ratio(a, b) for a, b in zip(rows[mode]["requests_per_s_rounds"], rows[first]["requests_per_s_rounds"])]
        vs_first[f"{mode}/{first}"] = {"requests_per_s": spread(per_round),
                                       "ttft_p50": ratio(rows[mode]["ttft_p50_ms"], rows[first]["ttft_p50_ms"]),
                                       "ttft_p95": ratio(rows[mode]["ttft_p95_ms"], rows[first]["ttft_p95_ms"])}
    return {"clients": args.concurrency, "rounds": args.throughput_rounds, "max_tokens": args.max_tokens,
            "answers": args.throughput_answers, "ignore_eos": is_ignoring_eos(args), "modes": rows,
            "ratios": vs_first, "schedule": schedule}


def summarize(runs: dict[str, ModeRuns], throughput: dict | None, args, ingest_s: float, model: str) -> dict:
    rows = {}
    for mode, run in runs.items():
        rates = [r for r in (s.decode_tokens_per_s for s in run.samples) if r is not None]
        rows[mode] = {
            "median_e2e_ttft_ms": median(s.ttft_ms for s in run.samples),
            "median_server_ttft_ms": median(s.timings.get("ttft_ms", 0.0) for s in run.samples),
            "median_tokens_per_s": median(rates) if rates else None,
            "median_prompt_tokens": median(s.usage.get("prompt_tokens", 0) for s in run.samples),
            "median_reused_tokens": median(s.usage.get("reused_tokens", 0) for s in run.samples),
            "answer_agreement_vs_full": mean(run.agrees),
            "f1_vs_full": mean(run.f1_full),
            "f1_vs_gold": mean(run.f1_gold),
            "throughput_rps": throughput["modes"][mode]["requests_per_s"]
            if throughput and mode in throughput["modes"] else None,
        }
    full, blend = rows.get("full"), rows.get("blend")
    speedup = full["median_e2e_ttft_ms"] / blend["median_e2e_ttft_ms"] if full and blend else None
    return {"bench": "server-modes", "url": args.url, "model": model, "questions": args.questions,
            "passages": args.passages, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "ingest_s": ingest_s, "blend_ttft_speedup_vs_full": speedup, "target_speedup": 4.0,
            "is_target_met": speedup is not None and speedup >= 4.0, "results": rows, "throughput": throughput}


def print_table(summary: dict) -> None:
    print(f"\nserver bench: {summary['model']}, {summary['questions']} questions x {summary['passages']} passages, "
          f"max_tokens {summary['max_tokens']}, ingest {summary['ingest_s']:.1f} s")
    if summary["results"]:
        print(table(["mode", "e2e TTFT ms", "server TTFT", "tok/s", "prompt", "reused", "agree", "F1 full", "F1 gold",
                     f"req/s@{summary['concurrency']}"], (
            [mode, fmt(r["median_e2e_ttft_ms"], 0), fmt(r["median_server_ttft_ms"], 0), fmt(r["median_tokens_per_s"]),
             fmt(r["median_prompt_tokens"], 0), fmt(r["median_reused_tokens"], 0), fmt(r["answer_agreement_vs_full"], 2),
             fmt(r["f1_vs_full"], 2), fmt(r["f1_vs_gold"], 2), fmt(r["throughput_rps"], 3)]
            for mode, r in summary["results"].items())))
    if summary["blend_ttft_speedup_vs_full"]:
        print(f"blend e2e TTFT speed-up vs full: {summary['blend_ttft_speedup_vs_full']:.2f}x (target 4x)")
    if summary["throughput"]:
        print_throughput(summary["throughput"])


def print_throughput(throughput: dict) -> None:
    length = (f"{throughput['max_tokens']} tokens each" if throughput["ignore_eos"]
              else f"answers ending at end of text (at most {throughput['max_tokens']} tokens)")
    print(f"\nthroughput: {throughput['clients']} clients at once, each its own question, {length}; "
          f"{throughput['rounds']} rounds, the modes alternated")
    print(table(["mode", "req/s", "[min-max]", "TTFT p50 ms", "TTFT p95 ms", "errors", "tokens/answer"], (
        [mode, fmt(row["requests_per_s"], 3), f"[{min(rounds):.3f}-{max(rounds):.3f}]", fmt(row["ttft_p50_ms"], 0),
         fmt(row["ttft_p95_ms"], 0), row["num_errors"], fmt(row["completion_tokens_per_answer"].get("mean", 0.0))]
        for mode, row in throughput["modes"].items() for rounds in [row["requests_per_s_rounds"]])))
    for name, r in throughput["ratios"].items():
        rps = r["requests_per_s"]
        cells = [f"req/s {rps['median']:.2f}x [{rps['min']:.2f}-{rps['max']:.2f}] (per round)" if rps["median"] else "req/s -"]
        cells += [f"TTFT {q} {r['ttft_' + q]:.2f}x" for q in ("p50", "p95") if r["ttft_" + q] is not None]
        print(f"{name}: " + ", ".join(cells))


def split_modes(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


async def bench(args: argparse.Namespace, questions: list[Question], auth: dict) -> dict:
    modes, throughput_modes = split_modes(args.modes), split_modes(args.throughput_modes)
    model, ingest_s = ingest_ready(args.url, auth, 600, questions)
    async with httpx.AsyncClient(base_url=args.url, headers=auth, timeout=600,
                                 limits=httpx.Limits(max_connections=None)) as client:
        runs = await latency_phase(client, questions, modes, args.max_tokens) if modes else {}
        rounds, schedule = await throughput_phase(client, questions, throughput_modes, args, is_warming_up=not modes) \
            if throughput_modes else ({}, [])
    return summarize(runs, throughput_summary(rounds, schedule, args), args, ingest_s, model)


def run(args: argparse.Namespace) -> int:
    if split_modes(args.throughput_modes) and (args.concurrency < 1 or args.throughput_rounds < 1
                                               or args.concurrency > args.questions):
        return refuse("server-modes", f"--concurrency {args.concurrency} must be 1 to --questions "
                      f"({args.questions}: each client asks its own), --throughput-rounds >= 1", ExitCode.USAGE)
    questions = load_questions(args.data, args.questions, args.passages)
    if len(questions) < args.questions:
        return refuse("server-modes", f"{args.data} has {len(questions)} questions, {args.questions} asked for",
                       ExitCode.USAGE)
    summary = asyncio.run(bench(args, questions, headers(args)))
    print_table(summary)
    emit_summary(summary, args.out, indent=2)
    errors = sum(row["num_errors"] for row in (summary["throughput"] or {"modes": {}})["modes"].values())
    return ExitCode.FAILED if errors else ExitCode.OK
