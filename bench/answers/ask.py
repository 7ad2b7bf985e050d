"""`ragblend bench answers`: does the whole pipeline answer right, on real documents? The settings side by
side through live servers, taking turns question by question; each answer scored right, inside, source,
ran to the cap, TTFT; then a MuSiQue part (docs/benchmarks/answers.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import httpx

from app.commands.client import error_message
from app.commands.exit_codes import ExitCode
from bench.answers.scoring import answer_record, paired, print_tables, results, score_document_answer, \
    score_musique_answer
from bench.answers.settings import SETTINGS, Setting, settings_named
from bench.harness.client import WARMUP_TOKENS, QueryFailed, StreamedAnswer, delete_documents, stream_query, \
    upload_documents, wait_for_kv
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary, refuse
from bench.harness.servers import started_server
from bench.harness.sets import DEFAULT_SET, QuestionSet, SetQuestion, contains_gold, load_set
from bench.harness.stats import in_turn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["dev", "test", "all"], default="all",
                        help="which half of the document questions to ask (all: both, reported apart)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated settings of bench/answers/settings.py (default: all: {','.join(SETTINGS)})")
    parser.add_argument("--repeats", type=int, default=1, help="times each question is asked in each setting")
    parser.add_argument("--musique", type=int, default=50, help="MuSiQue questions asked after the documents (0: none)")
    parser.add_argument("--musique-data", type=Path, default=Path("../shared/data/musique_dev.json"))
    parser.add_argument("--musique-passages", type=int, default=10, help="passages per MuSiQue question")
    parser.add_argument("--set", type=Path, default=DEFAULT_SET, help="the question set (documents and questions)")
    parser.add_argument("--questions", type=int,
                        help="at most this many document questions of the split, taken from each document in turn "
                             "(a quick check; default: all)")
    parser.add_argument("--max-tokens", type=int,
                        help="answer cap sent with every request (default: none sent: the server's generation.max_tokens)")
    parser.add_argument("--config", type=Path, help="a YAML file every server layers over the defaults "
                        "(each setting's server overrides go on top)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the servers as uvicorn threads in this process instead of `ragblend serve` children "
                             "(quicker to start; this client then shares their process)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for a server's /readyz")
    parser.add_argument("--kv-timeout", type=float, default=600.0,
                        help="seconds to wait for uploaded documents' background KV before asking")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--out", type=Path, help="also write the JSON summary here")


def server_groups(settings: Sequence[Setting]) -> dict[str, list[Setting]]:
    """Settings by their server overrides (one server each), in the order they first appear."""
    groups: dict[str, list[Setting]] = {}
    for setting in settings:
        groups.setdefault(setting.server_key, []).append(setting)
    return groups


# ---- ingest --------------------------------------------------------------------------------------


async def ingest_passages(client: httpx.AsyncClient, ids: Sequence[str], passages: Sequence[str],
                          kv_timeout_s: float) -> float:
    """A MuSiQue question's passages as documents (the server's own chunking, KV precomputed); seconds."""
    start = time.perf_counter()
    response = await client.post("/v1/documents", json={"documents": [{"id": i, "text": t} for i, t in zip(ids, passages)]})
    if response.status_code != 201:
        raise QueryFailed(f"ingesting passages {ids[0]}..: {error_message(response)}")
    await wait_for_kv(client, [d["id"] for d in response.json()["documents"] if d.get("kv_pending")], kv_timeout_s)
    return time.perf_counter() - start


# ---- asking and scoring ----------------------------------------------------------------------


def progress(message: str) -> None:
    """A line on stderr: a full run takes a while (stdout carries the table and the JSON)."""
    print(f"bench answers: {message}", file=sys.stderr, flush=True)


def request_body(setting: Setting, question: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"question": question, "prefix_cache": False}  # the warm-up asks it first: prefill again
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    return {**body, **setting.request}


async def ask(client: httpx.AsyncClient, setting: Setting, question: str, args: argparse.Namespace,
              record: dict[str, Any], score: Callable[[StreamedAnswer], dict[str, Any]]) -> dict[str, Any]:
    """`record` with the answer and its `score`, or with the error's text (a failed request is counted, not
    fatal)."""
    try:
        got = await stream_query(client, request_body(setting, question, args))
    except (QueryFailed, httpx.HTTPError) as exc:
        return {**record, "error": f"{type(exc).__name__}: {exc}"}
    return {**record, "error": None, **answer_record(got), **score(got)}


async def warm_up(clients: Mapping[str, httpx.AsyncClient], settings: Sequence[Setting], question: str,
                  args: argparse.Namespace) -> None:
    """One short answer per setting, not counted (first requests pay one-off costs)."""
    for setting in settings:
        await stream_query(clients[setting.server_key],
                           {**request_body(setting, question, args), "max_tokens": WARMUP_TOKENS})


async def document_part(clients: Mapping[str, httpx.AsyncClient], settings: Sequence[Setting],
                        questions: Sequence[SetQuestion], args: argparse.Namespace) -> list[dict[str, Any]]:
    await warm_up(clients, settings, questions[0].question, args)
    records = []
    for repeat in range(args.repeats):
        for qi, question in enumerate(questions):
            progress(f"documents: question {qi + 1}/{len(questions)}, repeat {repeat + 1}/{args.repeats}")
            for setting in in_turn(settings, qi + repeat):
                record = {"part": f"docs_{question.split}", "question": question.id, "document": question.document,
                          "setting": setting.name, "repeat": repeat}
                records.append(await ask(clients[setting.server_key], setting, question.question, args, record,
                                         lambda got: score_document_answer(question, got)))
    return records


async def musique_part(clients: Mapping[str, httpx.AsyncClient], settings: Sequence[Setting],
                       questions: Sequence[Question], args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Per question: its passages ingested on every server, asked in every setting, deleted again."""
    records, ingest_s = [], 0.0
    for mi, question in enumerate(questions):
        progress(f"MuSiQue: question {mi + 1}/{len(questions)}")
        ids = [f"musique-{mi}-{pi}" for pi in range(len(question.passages))]
        for client in clients.values():
            ingest_s += await ingest_passages(client, ids, question.passages, args.kv_timeout)
        if mi == 0:
            await warm_up(clients, settings, question.question, args)
        expected = {doc_id for doc_id, text in zip(ids, question.passages) if contains_gold(text, question.answers)}
        for repeat in range(args.repeats):
            for setting in in_turn(settings, mi + repeat):
                record = {"part": "musique", "question": f"musique-{mi}", "gold": list(question.answers),
                          "num_gold_passages": len(expected), "setting": setting.name, "repeat": repeat}
                records.append(await ask(clients[setting.server_key], setting, question.question, args, record,
                                         lambda got: score_musique_answer(question.answers, expected, got)))
        for client in clients.values():
            await delete_documents(client, ids)
    return records, ingest_s


# ---- the command ---------------------------------------------------------------------------------


def pick_questions(qset: QuestionSet, split: str, limit: int | None) -> list[SetQuestion]:
    """The split's questions; with `limit`, that many taken from each document in turn."""
    questions = qset.split(split)
    if limit is None or limit >= len(questions):
        return questions
    by_doc: dict[str, list[SetQuestion]] = {}
    for q in questions:
        by_doc.setdefault(q.document, []).append(q)
    picked: list[SetQuestion] = []
    for rank in range(max(len(qs) for qs in by_doc.values())):
        picked += [qs[rank] for qs in by_doc.values() if rank < len(qs)]
    return picked[:limit]


async def measure(urls: Mapping[str, str], settings: Sequence[Setting], qset: QuestionSet,
                  questions: Sequence[SetQuestion], musique: Sequence[Question], args: argparse.Namespace
                  ) -> dict[str, Any]:
    clients = {key: httpx.AsyncClient(base_url=url, timeout=args.timeout) for key, url in urls.items()}
    try:
        servers = []
        for key, client in clients.items():
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
            start = time.perf_counter()
            documents = await upload_documents(client, qset.documents, args.kv_timeout) if questions else {}
            progress(f"server {urls[key]}: {model}, {len(documents)} documents in "
                     f"{sum(d['num_chunks'] for d in documents.values())} chunks, {time.perf_counter() - start:.0f} s")
            servers.append({"settings": [s.name for s in settings if s.server_key == key], "overrides": json.loads(key),
                            "url": urls[key], "model": model, "ingest_s": time.perf_counter() - start,
                            "documents": documents})
        records = await document_part(clients, settings, questions, args) if questions else []
        musique_ingest_s = 0.0
        if musique:
            if questions:
                for client in clients.values():
                    await delete_documents(client, [d.id for d in qset.documents])
            musique_records, musique_ingest_s = await musique_part(clients, settings, musique, args)
            records += musique_records
    finally:
        for client in clients.values():
            await client.aclose()
    return {"servers": servers, "musique_ingest_s": musique_ingest_s, "records": records}


def check_args(args: argparse.Namespace) -> list[Setting]:
    settings = settings_named([name.strip() for name in args.settings.split(",") if name.strip()])
    if args.repeats < 1 or args.musique < 0 or args.musique_passages < 1 or (args.questions is not None and args.questions < 0):
        raise ValueError("--repeats and --musique-passages must be >= 1, --musique and --questions >= 0")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.config is not None and not args.config.is_file():
        raise ValueError(f"--config {args.config}: no such file")
    return settings


def run(args: argparse.Namespace) -> int:
    try:
        settings = check_args(args)
        qset = load_set(args.set)
        questions = pick_questions(qset, args.split, args.questions)
        musique = load_questions(args.musique_data, args.musique, args.musique_passages) if args.musique else []
    except (ValueError, FileNotFoundError) as exc:
        hint = " (--musique 0 leaves the MuSiQue part out)" if isinstance(exc, FileNotFoundError) else ""
        return refuse("answers", f"{exc}{hint}", ExitCode.USAGE)
    if not questions and not musique:
        return refuse("answers", "no questions to ask", ExitCode.USAGE)
    with contextlib.ExitStack() as stack:
        # One after the other: a server's loading planner times prefills while it starts, and a second
        # server starting meanwhile would slow those down.
        urls = {}
        for i, (key, group) in enumerate(server_groups(settings).items()):
            progress(f"starting a server for {', '.join(s.name for s in group)}")
            urls[key] = stack.enter_context(started_server(f"answers-{i}", group[0].server, args.config,
                                                           args.ready_timeout, args.in_process))
        try:
            measured = asyncio.run(measure(urls, settings, qset, questions, musique, args))
        except QueryFailed as exc:  # an upload, an ingest, a delete or a warm-up refused: nothing to score
            return refuse("answers", exc, ExitCode.FAILED)
    records = measured.pop("records")
    asked = Counter((q.document, q.split) for q in questions)
    summary = {
        "bench": "answers", "set": str(args.set), "model": measured["servers"][0]["model"], "split": args.split,
        "settings": [asdict(s) for s in settings], "repeats": args.repeats, "max_tokens": args.max_tokens,
        "documents": {d.id: {"file": d.path.name, "format": d.format, "origin": d.origin, "package": d.package}
                      for d in qset.documents},
        "questions_asked": {d.id: {s: asked[(d.id, s)] for s in ("dev", "test")} for d in qset.documents},
        "musique": {"num_questions": len(musique), "passages": args.musique_passages, "data": str(args.musique_data),
                    "ingest_s": measured["musique_ingest_s"]} if musique else None,
        "servers": measured["servers"],
        "results": results(records, settings),
        "paired": paired(records, settings),
        "answers": records,
    }
    print_tables(summary)
    emit_summary(summary, args.out, indent=2)
    return ExitCode.FAILED if any(r["error"] for r in records) else ExitCode.OK
