"""`ragblend bench server-modes`: end-to-end TTFT and fidelity per prefill mode against a running server.

Ingests the MuSiQue dev passages (one passage, one chunk, KV precomputed), then asks each question
with `chunk_ids` set to its passages in each mode, streaming: end-to-end TTFT (request sent to first
token received), decode tokens/s, answer agreement with `full`, token F1 vs the gold answers; then
throughput (requests/s) under concurrent clients, per mode at each client count (`--concurrency 8,16`:
blend's against full's, the measure of docs/benchmarks/gpu.md). Prints a table, then one JSON object as
the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median

import httpx

from bench.metrics import best_f1, normalize_answer, token_f1
from bench.musique import Question, load_questions
from bench.output import emit_summary
from bench.server_bench import concurrency_levels
from bench.server_client import chunk_ids, ingest, stream_query


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--data", type=Path, default=Path("../shared/data/musique_dev.json"))
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--latency-questions", type=int, default=None,
                        help="ask only the first N questions in every mode (default: all); the throughput phase "
                             "uses all of them")
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--modes", default="full,blend,reuse", help="comma-separated; full first (the reference)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=concurrency_levels, default=concurrency_levels("4"),
                        help="clients of the throughput phase, or several counts (e.g. 8,16): a phase each")
    parser.add_argument("--throughput-modes", default="full,blend")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")


@dataclass
class Sample:
    ttft_ms: float
    total_ms: float
    num_tokens: int
    answer: str
    server_ttft_ms: float
    reused_tokens: int
    prompt_tokens: int

    @property
    def tokens_per_s(self) -> float | None:
        decode_s = (self.total_ms - self.ttft_ms) / 1000
        return (self.num_tokens - 1) / decode_s if self.num_tokens > 1 and decode_s > 0 else None


@dataclass
class ModeRuns:
    samples: list[Sample] = field(default_factory=list)
    f1_gold: list[float] = field(default_factory=list)
    f1_full: list[float] = field(default_factory=list)
    agrees: list[float] = field(default_factory=list)


async def ask(client: httpx.AsyncClient, question: str, ids: list[str], mode: str, max_tokens: int) -> Sample:
    body = {"question": question, "chunk_ids": ids, "mode": mode, "max_tokens": max_tokens}
    answer = await stream_query(client, body)
    usage = answer.usage
    return Sample(answer.ttft_ms, answer.total_ms, answer.num_completion_tokens, answer.answer,
                  answer.timings.get("ttft_ms", 0.0), usage.get("reused_tokens", 0), usage.get("prompt_tokens", 0))


async def latency_phase(client, questions: list[Question], modes: list[str], max_tokens: int) -> dict[str, ModeRuns]:
    runs = {mode: ModeRuns() for mode in modes}
    await ask(client, questions[0].question, chunk_ids(0, questions[0]), modes[-1], 4)  # warm-up
    for qi, question in enumerate(questions):
        reference = None
        for mode in modes:
            sample = await ask(client, question.question, chunk_ids(qi, question), mode, max_tokens)
            reference = sample.answer if reference is None else reference
            run = runs[mode]
            run.samples.append(sample)
            run.f1_gold.append(best_f1(sample.answer, question.answers))
            run.f1_full.append(token_f1(sample.answer, reference))
            run.agrees.append(float(normalize_answer(sample.answer) == normalize_answer(reference)))
    return runs


async def throughput_phase(client, questions: list[Question], mode: str, concurrency: int, max_tokens: int) -> float:
    pending = list(enumerate(questions))

    async def worker():
        while pending:
            qi, question = pending.pop()
            await ask(client, question.question, chunk_ids(qi, question), mode, max_tokens)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return len(questions) / (time.perf_counter() - start)


def summarize(runs: dict[str, ModeRuns], throughput: dict[str, dict[int, float]], args, ingest_s: float,
              model: str) -> dict:
    """`throughput`: mode -> clients -> requests/s."""
    rows = {}
    largest = max(args.concurrency)
    for mode, run in runs.items():
        rates = [r for r in (s.tokens_per_s for s in run.samples) if r is not None]
        rows[mode] = {
            "median_e2e_ttft_ms": median(s.ttft_ms for s in run.samples),
            "median_server_ttft_ms": median(s.server_ttft_ms for s in run.samples),
            "median_tokens_per_s": median(rates) if rates else None,
            "median_prompt_tokens": median(s.prompt_tokens for s in run.samples),
            "median_reused_tokens": median(s.reused_tokens for s in run.samples),
            "answer_agreement_vs_full": mean(run.agrees),
            "f1_vs_full": mean(run.f1_full),
            "f1_vs_gold": mean(run.f1_gold),
            "throughput_rps": throughput.get(mode, {}).get(largest),  # at the largest client count
            "throughput_rps_by_clients": throughput.get(mode),
        }
    full, blend = rows.get("full"), rows.get("blend")
    speedup = full["median_e2e_ttft_ms"] / blend["median_e2e_ttft_ms"] if full and blend else None
    # blend's requests/s over full's at each client count (both measured)
    rps_ratio = {n: throughput["blend"][n] / throughput["full"][n] for n in args.concurrency
                 if n in throughput.get("blend", {}) and throughput.get("full", {}).get(n)}
    return {"bench": "server-modes", "url": args.url, "model": model, "questions": args.questions,
            "passages": args.passages, "max_tokens": args.max_tokens, "concurrency": args.concurrency,
            "ingest_s": ingest_s, "blend_ttft_speedup_vs_full": speedup, "target_speedup": 4.0,
            "is_target_met": speedup is not None and speedup >= 4.0,
            "blend_throughput_vs_full_by_clients": rps_ratio, "results": rows}


def print_table(summary: dict) -> None:
    print(f"\nserver bench: {summary['model']}, {summary['questions']} questions x {summary['passages']} passages, "
          f"max_tokens {summary['max_tokens']}, ingest {summary['ingest_s']:.1f} s")
    levels = summary["concurrency"]
    print(f"{'mode':<7}{'e2e TTFT ms':>12}{'server TTFT':>12}{'tok/s':>8}{'prompt':>8}{'reused':>8}"
          f"{'agree':>7}{'F1 full':>8}{'F1 gold':>8}" + "".join(f"{'req/s@' + str(n):>10}" for n in levels))
    for mode, r in summary["results"].items():
        by_clients = r["throughput_rps_by_clients"] or {}
        rps = "".join(f"{by_clients[n]:>10.3f}" if by_clients.get(n) else f"{'-':>10}" for n in levels)
        tps = f"{r['median_tokens_per_s']:.1f}" if r["median_tokens_per_s"] else "-"
        print(f"{mode:<7}{r['median_e2e_ttft_ms']:>12.0f}{r['median_server_ttft_ms']:>12.0f}{tps:>8}"
              f"{r['median_prompt_tokens']:>8.0f}{r['median_reused_tokens']:>8.0f}{r['answer_agreement_vs_full']:>7.2f}"
              f"{r['f1_vs_full']:>8.2f}{r['f1_vs_gold']:>8.2f}{rps}")
    if summary["blend_ttft_speedup_vs_full"]:
        print(f"blend e2e TTFT speed-up vs full: {summary['blend_ttft_speedup_vs_full']:.2f}x (target 4x)")
    for n, ratio in summary["blend_throughput_vs_full_by_clients"].items():
        print(f"{n} clients: blend {ratio:.2f}x full's requests/s")


async def bench(args: argparse.Namespace, questions: list[Question], headers: dict) -> dict:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    with httpx.Client(base_url=args.url, headers=headers, timeout=600) as client:
        client.get("/readyz").raise_for_status()
        model = client.get("/v1/models").json()["data"][0]["id"]
        ingest_s = ingest(client, questions)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        runs = await latency_phase(client, questions[: args.latency_questions], modes, args.max_tokens)
        throughput: dict[str, dict[int, float]] = {}
        for clients in args.concurrency:  # the modes side by side at each count
            for mode in [m.strip() for m in args.throughput_modes.split(",") if m.strip()]:
                throughput.setdefault(mode, {})[clients] = await throughput_phase(client, questions, mode, clients,
                                                                                  args.max_tokens)
    return summarize(runs, throughput, args, ingest_s, model)


def run(args: argparse.Namespace) -> int:
    questions = load_questions(args.data, args.questions, args.passages)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    summary = asyncio.run(bench(args, questions, headers))
    print_table(summary)
    emit_summary(summary, args.out, indent=2)
    return 0
