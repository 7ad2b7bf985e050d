"""`ragblend bench overhead`: the server's blend TTFT and decode against the bare engine's on the same prompts,
in turn, with the server's own timings to say where a gap lies (docs/benchmarks/overhead.md)."""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from statistics import median
from typing import Any, Sequence

import httpx

from bench.harness.args import add_data, add_out
from bench.harness.engine import Variant, load_engine, measure_decode, prompt_for, timed_prefill
from bench.harness.servers import LocalServer, environment_pairs, started
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary
from bench.harness.client import chunk_ids, ingest, stream_query
from bench.harness.stats import spread
from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode

PAUSE_S = 1.0  # between turns: the other side's spinning OpenMP threads sleep, its load leaves the window


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_data(parser, questions=6, first_question=20)  # past bench engine's tuning set
    parser.add_argument("--rounds", type=int, default=2, help="times each question is asked (default: %(default)s)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens of the decode part (0: none)")
    parser.add_argument("--config", type=Path, help="a settings YAML for the server and this process's engine")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment of the server only (repeatable)")
    add_out(parser)


def _engine_turn(engine: BlendEngine, question: Question, variant: Variant, cache: dict) -> dict[str, float]:
    segments = prompt_for(engine, question, variant.sink, cache)
    result, ms, _ = timed_prefill(engine, segments, variant, 1)
    return {"ttft_ms": ms, "prefill_ms": result.stats.prefill_ms, "prompt_tokens": len(result.token_ids),
            "recomputed_tokens": result.stats.num_recomputed_tokens}


async def _server_turn(client: httpx.AsyncClient, qi: int, question: Question, max_tokens: int) -> dict[str, Any]:
    # the prefix cache off: every round asks the same prompts again, and each must prefill as the engine's do
    answer = await stream_query(client, {"question": question.question, "chunk_ids": chunk_ids(qi, question),
                                         "mode": "blend", "max_tokens": max_tokens, "ignore_eos": True,
                                         "prefix_cache": False})
    timings, usage = answer.timings, answer.usage
    row: dict[str, Any] = {
        "ttft_ms": answer.ttft_ms, "server_ttft_ms": timings["ttft_ms"], "prefill_ms": timings["prefill_ms"],
        "kv_load_ms": timings["kv_load_ms"], "queue_ms": timings["queue_ms"], "retrieval_ms": timings["retrieval_ms"],
        "prompt_tokens": usage["prompt_tokens"], "recomputed_tokens": usage["recomputed_tokens"], "mode": answer.done["mode"],
    }
    if max_tokens > 1:
        row["decode_tokens_per_s"] = answer.decode_tokens_per_s
    return row


def run(args: argparse.Namespace) -> int:
    questions = load_questions(args.data, args.questions, args.passages, args.first_question)
    settings, engine = load_engine(args.config)
    variant = Variant("blend", PrefillMode.BLEND, settings.blend.sink, engine.blend)
    cache: dict[int, dict] = {qi: {} for qi in range(len(questions))}
    for qi, question in enumerate(questions):  # every prompt's chunk KV precomputed, and a first (slow) call
        _engine_turn(engine, question, variant, cache[qi])
    server = LocalServer("overhead", environment_pairs(args.server_env, "--server-env"), args.config)
    rows: dict[str, list[dict[str, Any]]] = {"engine": [], "server": []}
    with started(server, ready_timeout_s=900.0):
        with httpx.Client(base_url=server.url, timeout=900) as client:
            ingest(client, questions)
        rows = asyncio.run(_rounds(server.url, engine, questions, variant, cache, args))
        decode = _decode(engine, questions, variant, cache, server.url, args) if args.decode_tokens > 0 else None
    summary = summarize(rows, decode, args, engine)
    print_table(summary)
    emit_summary(summary, args.out, indent=1)
    return 0


async def _rounds(url: str, engine: BlendEngine, questions: Sequence[Question], variant: Variant,
                  cache: dict[int, dict], args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    rows: dict[str, list[dict[str, Any]]] = {"engine": [], "server": []}
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        for qi, question in enumerate(questions):  # the server's first call of each prompt, untimed
            await _server_turn(client, qi, question, 1)
        for rnd in range(args.rounds):
            for qi, question in enumerate(questions):
                sides = ("engine", "server") if (rnd + qi) % 2 == 0 else ("server", "engine")
                for side in sides:
                    await asyncio.sleep(PAUSE_S)
                    if side == "engine":
                        row = _engine_turn(engine, question, variant, cache[qi])
                    else:
                        row = await _server_turn(client, qi, question, 1)
                    rows[side].append({"round": rnd, "question": qi, "first": sides[0] == side, **row})
    return rows


def _decode(engine: BlendEngine, questions: Sequence[Question], variant: Variant, cache: dict[int, dict], url: str,
            args: argparse.Namespace) -> dict[str, list[float]]:
    """Tokens per second, the engine's decoder and the API's, alternated question by question."""
    figures: dict[str, list[float]] = {"engine": [], "server": []}

    async def server_rate(client: httpx.AsyncClient, qi: int) -> float:
        return (await _server_turn(client, qi, questions[qi], args.decode_tokens))["decode_tokens_per_s"]

    async def both() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            for qi, question in enumerate(questions):
                time.sleep(PAUSE_S)
                segments = prompt_for(engine, question, variant.sink, cache[qi])
                figures["engine"].append(1000 / measure_decode(engine, segments, args.decode_tokens,
                                                               with_hf=False).engine_ms_per_token)
                time.sleep(PAUSE_S)
                figures["server"].append(await server_rate(client, qi))

    asyncio.run(both())
    return figures


def summarize(rows: dict[str, list[dict[str, Any]]], decode: dict[str, list[float]] | None,
              args: argparse.Namespace, engine: BlendEngine) -> dict[str, Any]:
    engine_ms = {(r["round"], r["question"]): r["ttft_ms"] for r in rows["engine"]}
    ratios = [r["ttft_ms"] / engine_ms[(r["round"], r["question"])] for r in rows["server"]]
    server = rows["server"]

    def med(key: str, side: list[dict[str, Any]] = server) -> float:
        return median(r[key] for r in side)

    breakdown = {
        "queue_ms": med("queue_ms"), "retrieval_ms": med("retrieval_ms"), "kv_load_ms": med("kv_load_ms"),
        "prefill_ms": med("prefill_ms"),
        "after_prefill_ms": median(r["server_ttft_ms"] - r["prefill_ms"] - r["queue_ms"] - r["retrieval_ms"]
                                   for r in server),
        "http_sse_ms": median(r["ttft_ms"] - r["server_ttft_ms"] for r in server),
    }
    summary: dict[str, Any] = {
        "bench": "overhead", "model": engine.model_name, "questions": args.questions, "passages": args.passages,
        "rounds": args.rounds, "server_env": environment_pairs(args.server_env, "--server-env"),
        "prompt_tokens_match": all(r["prompt_tokens"] == e["prompt_tokens"]
                                   for r, e in zip(sorted(server, key=_key), sorted(rows["engine"], key=_key))),
        "ttft_ms": {"engine": med("ttft_ms", rows["engine"]), "server": med("ttft_ms")},
        "engine_prefill_ms": med("prefill_ms", rows["engine"]),
        "ttft_server_over_engine": spread(ratios),
        "server_breakdown_ms": breakdown,
        "rows": rows,
    }
    if decode is not None:
        rates = [s / e for s, e in zip(decode["server"], decode["engine"])]
        summary["decode"] = {"tokens": args.decode_tokens, "engine_tokens_per_s": median(decode["engine"]),
                             "server_tokens_per_s": median(decode["server"]), "server_over_engine": spread(rates),
                             "rows": decode}
    return summary


def _key(row: dict[str, Any]) -> tuple[int, int]:
    return row["round"], row["question"]


def print_table(summary: dict[str, Any]) -> None:
    ttft, ratio = summary["ttft_ms"], summary["ttft_server_over_engine"]
    print(f"blend TTFT, median of {summary['questions']} questions x {summary['rounds']} rounds "
          f"(same prompts: {summary['prompt_tokens_match']})")
    print(f"  engine (in process)   {ttft['engine']:8.0f} ms   (its prefill {summary['engine_prefill_ms']:.0f} ms)")
    print(f"  server (/v1/query)    {ttft['server']:8.0f} ms   server/engine {ratio['median']:.3f} "
          f"[{ratio['min']:.3f}-{ratio['max']:.3f}]")
    print("  server's parts (ms):  " + "  ".join(f"{k.removesuffix('_ms')} {v:.0f}"
                                                for k, v in summary["server_breakdown_ms"].items()))
    decode = summary.get("decode")
    if decode:
        r = decode["server_over_engine"]
        print(f"decode, {decode['tokens']} tokens: engine {decode['engine_tokens_per_s']:.1f} tok/s, server "
              f"{decode['server_tokens_per_s']:.1f} tok/s, server/engine {r['median']:.3f} [{r['min']:.3f}-{r['max']:.3f}]")
