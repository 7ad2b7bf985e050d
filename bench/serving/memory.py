"""`ragblend bench memory`: where a server's memory goes, stage by stage through start-up (memory_stages, in a
fresh interpreter) and a live server's idle and after questions, the two caches apart (docs/benchmarks/memory.md)."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.harness.client import metrics, upload_documents
from bench.harness.sets import DEFAULT_SET, load_set
from bench.harness.memory import MB, mappings, read_rss
from bench.harness.output import emit_summary, fmt, table
from bench.harness.servers import child_summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="a YAML config file for the server and the stages")
    parser.add_argument("--questions", type=int, default=6, help="questions asked (the answers set's, in order)")
    parser.add_argument("--documents", type=int, default=None,
                        help="documents of the answers set uploaded (default: those the questions are about)")
    parser.add_argument("--max-tokens", type=int, default=64, help="each answer's token cap")
    parser.add_argument("--idle-s", type=float, default=35.0,
                        help="seconds waited before each idle reading: longer than the server's "
                             "scheduler.idle_release_s (default 30)")
    parser.add_argument("--ready-timeout", type=float, default=600.0)
    parser.add_argument("--no-stages", action="store_true", help="skip the stage-by-stage part")
    parser.add_argument("--no-server", action="store_true", help="skip the live server part")
    parser.add_argument("--out", default=None, help="also write the JSON summary here")


def run_stages(config: Path | None, timeout_s: float) -> dict[str, Any]:
    """bench/serving/memory_stages.py in a fresh interpreter on an empty data dir: its summary."""
    with tempfile.TemporaryDirectory(prefix="ragblend-memory-stages-") as tmp:
        argv = ["bench.serving.memory_stages", "--data-dir", str(Path(tmp) / "data")]
        if config is not None:
            argv += ["--config", str(config)]
        return child_summary(argv, "the stages process", timeout_s)


def reading(pid: int, client: httpx.Client, label: str) -> dict[str, Any]:
    """RSS, and the two caches' bytes in it (the memory tier's, the prefix cache's; 0 where absent), in MB."""
    rss, found = read_rss(pid), metrics(client)
    tier, prefix = (round(found.get(name, {}).get(key, 0.0) / MB, 1)
                    for name, key in (("kv_bytes", "memory"), ("prefix_cache_bytes", "")))
    return {"label": label, **asdict(rss), "memory_tier_mb": tier, "prefix_cache_mb": prefix,
            "own_mb": round(rss.rss_mb - tier - prefix, 1), "mappings_mb": mappings(pid)}


def exercise(client: httpx.Client, num_questions: int, num_documents: int | None, max_tokens: int,
             kv_timeout_s: float) -> dict[str, Any]:
    """Upload the answers set's documents (those of the first `num_questions` questions, or the first
    `num_documents`), wait for their KV, then ask the questions one at a time (blend, streamed off)."""
    qset = load_set(DEFAULT_SET)
    questions = list(qset.questions[:num_questions])
    wanted = {q.document for q in questions}
    documents = [d for d in qset.documents if d.id in wanted] if num_documents is None else \
        list(qset.documents[:num_documents])

    async def upload() -> None:
        async with httpx.AsyncClient(base_url=client.base_url, headers=client.headers, timeout=kv_timeout_s) as http:
            await upload_documents(http, documents, kv_timeout_s)

    asyncio.run(upload())
    ttfts = []
    for question in questions:
        response = client.post("/v1/query", json={"question": question.question, "max_tokens": max_tokens})
        if response.status_code != 200:
            raise RuntimeError(f"asking {question.id}: {response.status_code} {response.text[:300]}")
        ttfts.append(response.json()["timings"]["ttft_ms"])
    return {"documents": [d.id for d in documents], "questions": [q.id for q in questions], "ttft_ms": ttfts}


def run_server(config: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """A `ragblend serve` child: read ready and idle, after uploads and questions, and idle again."""
    from bench.harness.servers import LocalServer, started

    with started(LocalServer("memory", config=config), args.ready_timeout) as server:
        pid = server.process.pid
        with httpx.Client(base_url=server.url, timeout=args.ready_timeout) as client:
            readings = [reading(pid, client, "ready")]
            time.sleep(args.idle_s)
            readings.append(reading(pid, client, "ready, idle"))
            run = exercise(client, args.questions, args.documents, args.max_tokens, args.ready_timeout)
            readings.append(reading(pid, client, "after the questions"))
            time.sleep(args.idle_s)
            readings.append(reading(pid, client, "after the questions, idle"))
            return {"readings": readings, "run": run}


def print_tables(summary: dict[str, Any]) -> None:
    stages = summary.get("stages")
    if stages:
        rows = stages["stages"]
        print(table(["stage", "RSS MB", "anon", "file", "added", "malloc used", "malloc free"], (
            [row["stage"], fmt(row["rss_mb"], 0), fmt(row["anon_mb"], 0), fmt(row["file_mb"], 0),
             f"{row['rss_mb'] - (rows[i - 1]['rss_mb'] if i else 0.0):+.0f}", fmt(row.get("malloc_used_mb", 0), 0),
             fmt(row.get("malloc_free_mb", 0), 0)] for i, row in enumerate(rows)), markdown=True))
        print("\nweights (MB):", ", ".join(f"{k} {v}" for k, v in stages["weights_mb"].items()))
    server = summary.get("server")
    if server:
        print("\n" + table(["server", "RSS MB", "anon", "file", "peak", "memory tier", "prefix cache",
                            "RSS less the two caches"], ([row["label"], *(fmt(row[key], 0) for key in (
                                "rss_mb", "anon_mb", "file_mb", "peak_mb", "memory_tier_mb", "prefix_cache_mb",
                                "own_mb"))] for row in server["readings"]), markdown=True))


def run(args: argparse.Namespace) -> int:
    if args.questions < 1:
        raise ValueError("--questions must be at least 1")
    summary: dict[str, Any] = {"config": yaml.safe_load(args.config.read_text()) if args.config else None}
    if not args.no_stages:
        summary["stages"] = run_stages(args.config, args.ready_timeout)
    if not args.no_server:
        summary["server"] = run_server(args.config, args)
    print_tables(summary)
    emit_summary(summary, args.out, indent=1)
    return 0
