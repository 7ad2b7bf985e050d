"""`ragblend bench prefix`: the prefix cache against a running server, its rows side by side per question (a
fresh blend, no match, an exact repeat, a follow-up with and without the cache) and issue 42's targets
(docs/design/kv-store.md#the-prefix-cache)."""

from __future__ import annotations

import argparse
import asyncio
import platform
import re
from statistics import median
from typing import Any

import httpx

from bench.harness.args import add_data, add_out, add_server, headers
from bench.harness.client import StreamedAnswer, chunk_ids, ingest_ready, stream_chat
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary

ROWS = ("blend, cache off", "no match", "exact repeat", "follow-up", "follow-up, cache off")
FOLLOW_UP = "Which of the passages says so? Quote it."
TARGET_EXACT_MS = 143.0  # vLLM's TTFT of the same prompt again, on the same VM (issue 42)
TARGET_FOLLOW_UP_RATIO = 0.3
TARGET_NO_MATCH_RATIO = 1.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server(parser)
    add_data(parser, questions=10, first_question=0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--mode", default=None, help="the requests' mode (default: the server's)")
    parser.add_argument("--follow-up", default=FOLLOW_UP, help="the follow-up turn's question")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_out(parser)


def chat_body(question: Question, qi: int, args: argparse.Namespace, history: list[dict[str, str]],
              is_cached: bool) -> dict[str, Any]:
    messages = [*history, {"role": "user", "content": question.question if not history else args.follow_up}]
    body: dict[str, Any] = {"messages": messages, "chunk_ids": chunk_ids(qi, question), "max_tokens": args.max_tokens,
                            "temperature": 0.0, "prefix_cache": is_cached}
    if args.mode:
        body["mode"] = args.mode
    return body


async def measure_question(client: httpx.AsyncClient, question: Question, qi: int,
                           args: argparse.Namespace) -> dict[str, StreamedAnswer]:
    """The five rows of one question; each pair (cache off / on) in an order alternating with qi."""
    out: dict[str, StreamedAnswer] = {}

    async def ask(row: str, history: list[dict[str, str]], is_cached: bool) -> StreamedAnswer:
        out[row] = await stream_chat(client, chat_body(question, qi, args, history, is_cached))
        return out[row]

    fresh = [("blend, cache off", False), ("no match", True)]
    for row, is_cached in fresh if qi % 2 == 0 else fresh[::-1]:
        await ask(row, [], is_cached)
    await ask("exact repeat", [], True)
    history = [{"role": "user", "content": question.question},
               {"role": "assistant", "content": out["no match"].answer}]
    follow = [("follow-up, cache off", False), ("follow-up", True)]
    for row, is_cached in follow if qi % 2 == 0 else follow[::-1]:
        await ask(row, history, is_cached)
    return out


def metric(text: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def row_stats(samples: list[StreamedAnswer]) -> dict[str, Any]:
    def usage(name: str) -> float:
        return median(s.usage.get(name, 0) for s in samples)

    return {
        "ttft_p50_ms": round(median(s.ttft_ms for s in samples), 1),
        "ttft_ms": [round(s.ttft_ms, 1) for s in samples],
        "server_ttft_p50_ms": round(median(s.timings.get("ttft_ms", 0.0) for s in samples), 1),
        "server_prefill_p50_ms": round(median(s.timings.get("prefill_ms", 0.0) for s in samples), 1),
        "prompt_tokens_p50": usage("prompt_tokens"),
        "prefix_cached_tokens_p50": usage("prefix_cached_tokens"),
        "recomputed_tokens_p50": usage("recomputed_tokens"),
        "modes": sorted({str(s.done.get("mode")) for s in samples}),
        "plans": sorted({(s.done.get("plan") or {}).get("plan", "-") for s in samples}),
    }


def summarize(answers: list[dict[str, StreamedAnswer]], args: argparse.Namespace, model: str, ingest_s: float,
              metrics_text: str) -> dict[str, Any]:
    rows = {row: row_stats([a[row] for a in answers]) for row in ROWS}
    ttft = {row: rows[row]["ttft_p50_ms"] for row in ROWS}
    no_match = ttft["no match"] / ttft["blend, cache off"]
    follow_up = ttft["follow-up"] / ttft["follow-up, cache off"]
    cache_bytes = metric(metrics_text, "ragblend_prefix_cache_bytes")
    cache_bound = metric(metrics_text, "ragblend_prefix_cache_max_bytes")
    return {
        "bench": "prefix", "url": args.url, "model": model, "questions": len(answers),
        "first_question": args.first_question, "passages": args.passages, "max_tokens": args.max_tokens,
        "mode": args.mode or "server default", "follow_up": args.follow_up, "ingest_s": round(ingest_s, 1),
        "machine": platform.machine(), "rows": rows,
        "targets": {
            "exact_repeat_ttft_ms": {"value": ttft["exact repeat"], "target_max": TARGET_EXACT_MS,
                                     "is_met": ttft["exact repeat"] <= TARGET_EXACT_MS},
            "follow_up_vs_fresh_blend": {"value": round(follow_up, 3), "target_max": TARGET_FOLLOW_UP_RATIO,
                                         "is_met": follow_up <= TARGET_FOLLOW_UP_RATIO},
            "no_match_vs_cache_off": {"value": round(no_match, 3), "target_max": TARGET_NO_MATCH_RATIO,
                                      "is_met": no_match <= TARGET_NO_MATCH_RATIO},
            "prefix_cache_bytes": {"value": cache_bytes, "target_max": cache_bound,
                                   "is_met": cache_bytes is not None and cache_bound is not None
                                   and cache_bytes <= cache_bound},
        },
        "prefix_cache_metrics": {name: metric(metrics_text, f"ragblend_prefix_cache_{name}") for name in
                                 ("lookups_total{result=\"hit\"}", "lookups_total{result=\"partial\"}",
                                  "lookups_total{result=\"miss\"}", "entries", "evictions_total")},
    }


def print_table(summary: dict[str, Any]) -> None:
    print(f"\nprefix cache bench: {summary['model']}, {summary['questions']} questions x {summary['passages']} "
          f"passages (from question {summary['first_question']}), max_tokens {summary['max_tokens']}, "
          f"mode {summary['mode']}")
    print(f"{'row':<22}{'e2e TTFT ms':>12}{'server TTFT':>12}{'prefill ms':>11}{'prompt':>8}{'cached':>8}"
          f"{'computed':>9}  plan")
    for row, r in summary["rows"].items():
        print(f"{row:<22}{r['ttft_p50_ms']:>12.0f}{r['server_ttft_p50_ms']:>12.0f}{r['server_prefill_p50_ms']:>11.0f}"
              f"{r['prompt_tokens_p50']:>8.0f}{r['prefix_cached_tokens_p50']:>8.0f}{r['recomputed_tokens_p50']:>9.0f}"
              f"  {','.join(r['plans'])}")
    for name, t in summary["targets"].items():
        print(f"{name}: {t['value']} (target <= {t['target_max']}): {'met' if t['is_met'] else 'NOT met'}")


async def bench(args: argparse.Namespace, questions: list[Question], auth: dict[str, str]) -> dict[str, Any]:
    model, ingest_s = ingest_ready(args.url, auth, args.timeout, questions)
    async with httpx.AsyncClient(base_url=args.url, headers=auth, timeout=args.timeout) as client:
        warm_up = {**chat_body(questions[0], 0, args, [], False), "max_tokens": 4}
        await stream_chat(client, warm_up)  # a server's first answer pays one-off costs; the cache stays empty
        answers = [await measure_question(client, q, qi, args) for qi, q in enumerate(questions)]
        metrics_text = (await client.get("/metrics")).text
    return summarize(answers, args, model, ingest_s, metrics_text)


def run(args: argparse.Namespace) -> int:
    questions = load_questions(args.data, args.questions, args.passages, args.first_question)
    if not questions:
        raise ValueError(f"no questions left after skipping {args.first_question}")
    summary = asyncio.run(bench(args, questions, headers(args)))
    print_table(summary)
    emit_summary(summary, args.out, indent=2)
    return 0
