"""`ragblend bench answers`: does the whole pipeline answer right, on real documents?

Starts a server per distinct set of server settings (`ragblend serve` children on fresh data dirs, or
uvicorn threads in this process with --in-process), uploads the question set's documents through
POST /v1/documents/files (extraction and chunking as a user's upload gets them, KV precomputed), then
asks every question in every setting through a streaming POST /v1/query, the settings taking turns
question by question (the first setting moves on by one each question) so that drift hits all alike.
Per answer: right (the question's pattern matches the answer), inside (its evidence pattern matches the
text of a chunk the prompt held), the right source first among the sources and among them at all, ran to
max_tokens (finish_reason `length`), TTFT (request sent to first token, here). Then a MuSiQue part: each
question's passages ingested as documents (the doc set deleted first), the question asked in every
setting, its passages deleted again; right and inside by the gold answers, normalized.
Prints a table per part (documents: test half, dev half; MuSiQue), then one JSON object as the last line.
The settings are bench/answers_settings.py; the questions bench/data/answers/questions.json
(docs/benchmarks/answers.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import httpx
import yaml
from scipy.stats import binomtest

from app.commands.client import error_message
from app.commands.exit_codes import ExitCode
from bench.harness.sets import REFUSAL, DEFAULT_SET, QuestionSet, SetQuestion, collapse, contains_gold, load_set
from bench.answers_settings import SETTINGS, Setting, settings_named
from bench.harness.stats import safe_median
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary
from bench.harness.client import QueryFailed, StreamedAnswer, stream_query

WARMUP_TOKENS = 4
KV_POLL_S = 0.2
PARTS = {"docs_test": "documents, test half", "docs_dev": "documents, dev half", "musique": "MuSiQue"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--split", choices=["dev", "test", "all"], default="all",
                        help="which half of the document questions to ask (all: both, reported apart)")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated settings of bench/answers_settings.py (default: all: {','.join(SETTINGS)})")
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


# ---- servers -------------------------------------------------------------------------------------


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `top` laid over it, nested mappings merged key by key."""
    out = dict(base)
    for key, value in top.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) \
            else value
    return out


@contextlib.contextmanager
def started_server(name: str, overrides: Mapping[str, Any], args: argparse.Namespace) -> Iterator[str]:
    """A fresh server with `overrides` over --config (over the defaults), on an empty temporary data
    dir; yields its URL once ready, stops it on exit."""
    with tempfile.TemporaryDirectory(prefix=f"ragblend-bench-{name}-") as tmp:
        if args.in_process:
            from app.testing import LiveServer
            from configs.settings import load_settings

            settings = load_settings(args.config, **deep_merge(overrides, {"data_dir": Path(tmp) / "data"}))
            with LiveServer(settings, ready_timeout_s=args.ready_timeout) as live:
                yield live.url
        else:
            from bench.harness.servers import LocalServer, started

            base = yaml.safe_load(args.config.read_text()) if args.config else None
            config = Path(tmp) / "config.yaml"
            config.write_text(yaml.safe_dump(deep_merge(base or {}, overrides)))
            with started(LocalServer(name, config=config), args.ready_timeout) as server:
                yield server.url


def server_groups(settings: Sequence[Setting]) -> dict[str, list[Setting]]:
    """Settings by their server overrides (one server each), in the order they first appear."""
    groups: dict[str, list[Setting]] = {}
    for setting in settings:
        groups.setdefault(setting.server_key, []).append(setting)
    return groups


# ---- ingest --------------------------------------------------------------------------------------


async def upload_documents(client: httpx.AsyncClient, qset: QuestionSet, kv_timeout_s: float) -> dict[str, dict]:
    """Every document of the set through POST /v1/documents/files, one file a request, under its set
    id; then waits for any background KV. Per document: format, pages, chunks, seconds."""
    out: dict[str, dict] = {}
    for doc in qset.documents:
        start = time.perf_counter()
        response = await client.post("/v1/documents/files", files=[("files", (doc.path.name, doc.path.read_bytes()))],
                                     data={"ids": doc.id})
        if response.status_code != 201:
            raise QueryFailed(f"uploading {doc.path.name}: {error_message(response)}")
        (document,) = response.json()["documents"]
        out[doc.id] = {"format": document["format"], "num_pages": document.get("num_pages"),
                       "num_chunks": len(document["chunks"]), "num_tokens": sum(c["num_tokens"] for c in document["chunks"]),
                       "upload_s": time.perf_counter() - start, "kv_pending": document.get("kv_pending", False)}
    await wait_for_kv(client, [d for d, info in out.items() if info["kv_pending"]], kv_timeout_s)
    return out


async def wait_for_kv(client: httpx.AsyncClient, doc_ids: Sequence[str], timeout_s: float) -> None:
    """Until every chunk of `doc_ids` has its KV (a large document's is computed in the background, and
    a question asked meanwhile would wait for it)."""
    deadline = time.monotonic() + timeout_s
    for doc_id in doc_ids:
        while True:
            response = await client.get(f"/v1/documents/{doc_id}")
            if response.status_code != 200:
                raise QueryFailed(f"reading document {doc_id}: {error_message(response)}")
            if all(chunk["kv_cached"] for chunk in response.json()["chunks"]):
                break
            if time.monotonic() > deadline:
                raise QueryFailed(f"document {doc_id}'s KV not computed within {timeout_s:.0f} s (--kv-timeout)")
            await asyncio.sleep(KV_POLL_S)


async def ingest_passages(client: httpx.AsyncClient, ids: Sequence[str], passages: Sequence[str],
                          kv_timeout_s: float) -> float:
    """A MuSiQue question's passages as documents (the server's own chunking, KV precomputed); seconds."""
    start = time.perf_counter()
    response = await client.post("/v1/documents", json={"documents": [{"id": i, "text": t} for i, t in zip(ids, passages)]})
    if response.status_code != 201:
        raise QueryFailed(f"ingesting passages {ids[0]}..: {error_message(response)}")
    await wait_for_kv(client, [d["id"] for d in response.json()["documents"] if d.get("kv_pending")], kv_timeout_s)
    return time.perf_counter() - start


async def delete_documents(client: httpx.AsyncClient, ids: Sequence[str]) -> None:
    for doc_id in ids:
        response = await client.delete(f"/v1/documents/{doc_id}")
        if response.status_code != 200:
            raise QueryFailed(f"deleting document {doc_id}: {error_message(response)}")


# ---- asking and scoring ----------------------------------------------------------------------


def progress(message: str) -> None:
    """A line on stderr: a full run takes a while (stdout carries the table and the JSON)."""
    print(f"bench answers: {message}", file=sys.stderr, flush=True)


def in_turn(settings: Sequence[Setting], turn: int) -> list[Setting]:
    """The settings starting from the `turn`th (mod their number): each takes every place in turn."""
    k = turn % len(settings)
    return [*settings[k:], *settings[:k]]


def request_body(setting: Setting, question: str, args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"question": question, "prefix_cache": False}  # the warm-up asks it first: prefill again
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    return {**body, **setting.request}


def answer_record(streamed: StreamedAnswer) -> dict[str, Any]:
    """What every scored answer keeps, whatever the part."""
    return {"answer": streamed.answer, "finish_reason": streamed.finish_reason,
            "ran_to_cap": streamed.finish_reason == "length", "ttft_ms": streamed.ttft_ms,
            "server_ttft_ms": streamed.timings.get("ttft_ms"), "mode": streamed.done.get("mode"),
            "completion_tokens": streamed.num_completion_tokens, "prompt_tokens": streamed.usage.get("prompt_tokens"),
            "sources": [s["document_id"] for s in streamed.sources],
            "chunks": [s["chunk_id"] for s in streamed.sources],
            # each source's cosine similarity to the question (the relevance floor's measure): how close an
            # out-of-scope question's best chunk comes to an in-scope one's
            "scores": [s.get("score") for s in streamed.sources],
            # the answer's numbers and names no source holds (app/rag/grounding.py); None: the server
            # does not check (a build before the check)
            "unsupported": streamed.done.get("unsupported"),
            # the question's words no searched chunk holds (retrieval.flag_unmatched_words); None: not said
            "unmatched_words": None if streamed.unmatched_words is None else list(streamed.unmatched_words)}


def score_document_answer(question: SetQuestion, streamed: StreamedAnswer) -> dict[str, Any]:
    """In scope: right, inside, the right source; out of scope (no document states it): right when the
    answer refuses, and no inside or source score (None)."""
    docs = [s["document_id"] for s in streamed.sources]
    is_refusal = REFUSAL.search(collapse(streamed.answer)) is not None
    if question.is_out_of_scope:
        return {"right": question.is_right(streamed.answer), "inside": None, "source_top": None, "source_any": None,
                "refused": is_refusal, "out_of_scope": True}
    return {"right": question.is_right(streamed.answer),
            "inside": question.is_inside(s["text"] for s in streamed.sources),
            "source_top": bool(docs) and docs[0] == question.document, "source_any": question.document in docs,
            "refused": is_refusal, "out_of_scope": False}


def score_musique_answer(golds: Sequence[str], expected: set[str], streamed: StreamedAnswer) -> dict[str, Any]:
    """`expected`: the question's passages that hold a gold answer (no source is right when none does:
    None then)."""
    docs = [s["document_id"] for s in streamed.sources]
    return {"right": contains_gold(streamed.answer, golds),
            "inside": any(contains_gold(s["text"], golds) for s in streamed.sources),
            "refused": REFUSAL.search(collapse(streamed.answer)) is not None,
            "source_top": (bool(docs) and docs[0] in expected) if expected else None,
            "source_any": bool(expected & set(docs)) if expected else None}


async def ask(client: httpx.AsyncClient, setting: Setting, question: str, args: argparse.Namespace
              ) -> StreamedAnswer | str:
    """The streamed answer, or the error's text (a failed request is counted, not fatal)."""
    try:
        return await stream_query(client, request_body(setting, question, args))
    except (QueryFailed, httpx.HTTPError) as exc:
        return f"{type(exc).__name__}: {exc}"


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
                got = await ask(clients[setting.server_key], setting, question.question, args)
                record = {"part": f"docs_{question.split}", "question": question.id, "document": question.document,
                          "setting": setting.name, "repeat": repeat}
                if isinstance(got, str):
                    records.append({**record, "error": got})
                else:
                    records.append({**record, "error": None, **answer_record(got), **score_document_answer(question, got)})
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
                got = await ask(clients[setting.server_key], setting, question.question, args)
                record = {"part": "musique", "question": f"musique-{mi}", "gold": list(question.answers),
                          "num_gold_passages": len(expected), "setting": setting.name, "repeat": repeat}
                if isinstance(got, str):
                    records.append({**record, "error": got})
                else:
                    records.append({**record, "error": None, **answer_record(got),
                                    **score_musique_answer(question.answers, expected, got)})
        for client in clients.values():
            await delete_documents(client, ids)
    return records, ingest_s


# ---- summary -------------------------------------------------------------------------------------


def share(flags: Sequence[bool | None]) -> float | None:
    scored = [f for f in flags if f is not None]
    return sum(scored) / len(scored) if scored else None


def part_row(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One setting's figures over one part's answers (failed requests counted apart, in no rate). Right,
    inside and sources are over the in-scope questions; the out-of-scope ones count apart (`oos_refused`:
    answered with a refusal, as they should be), and `refused` is the share of in-scope ones refused.
    `flagged`: answers warned of a number or name no source holds (in scope: how many, and how many of
    them right; out of scope: how many of those not refused); `unmatched`: the same for answers warned that
    no document uses a word of the question; `num_oos_unwarned`: neither refused nor warned either way, a
    made-up answer presented as found."""
    done = [r for r in records if r["error"] is None]
    ok = [r for r in done if not r.get("out_of_scope")]
    oos = [r for r in done if r.get("out_of_scope")]
    ttfts = sorted(r["ttft_ms"] for r in ok)
    inside = [r for r in ok if r["inside"]]
    return {
        "num_questions": len({r["question"] for r in records}), "num_answers": len(ok),
        "num_errors": len(records) - len(done), "errors": [r["error"] for r in records if r["error"] is not None][:5],
        "right": share([r["right"] for r in ok]), "num_right": sum(r["right"] for r in ok),
        "inside": share([r["inside"] for r in ok]), "num_inside": len(inside),
        "right_when_inside": share([r["right"] for r in inside]),
        "source_top": share([r["source_top"] for r in ok]), "source_any": share([r["source_any"] for r in ok]),
        "num_source_scored": sum(r["source_top"] is not None for r in ok),
        "ran_to_cap": share([r["ran_to_cap"] for r in ok]), "num_ran_to_cap": sum(r["ran_to_cap"] for r in ok),
        "refused": share([r.get("refused", False) for r in ok]), "num_refused": sum(r.get("refused", False) for r in ok),
        "num_out_of_scope": len(oos), "oos_refused": share([r["right"] for r in oos]),
        "num_oos_refused": sum(r["right"] for r in oos),
        "num_flagged": _num_flagged(ok), "num_right_flagged": _num_flagged([r for r in ok if r["right"]]),
        "num_oos_flagged": _num_flagged(oos),
        "num_unmatched": _num_unmatched(ok), "num_right_unmatched": _num_unmatched([r for r in ok if r["right"]]),
        "num_oos_unmatched": _num_unmatched([r for r in oos if not r["right"]]),
        "num_oos_unwarned": sum(not r["right"] and not r.get("unsupported") and not r.get("unmatched_words")
                                for r in oos),
        "ttft_p50_ms": safe_median(ttfts),
        "ttft_p90_ms": statistics.quantiles(ttfts, n=10, method="inclusive")[-1] if len(ttfts) > 1 else safe_median(ttfts),
        "server_ttft_p50_ms": safe_median(r["server_ttft_ms"] for r in ok if r["server_ttft_ms"] is not None),
        "completion_tokens_mean": share([r["completion_tokens"] for r in ok]),
        "prompt_tokens_mean": share([r["prompt_tokens"] for r in ok if r.get("prompt_tokens") is not None]),
        "modes": dict(Counter(r["mode"] for r in ok)),
    }


def _num_flagged(records: Sequence[dict[str, Any]]) -> int:
    return sum(bool(r.get("unsupported")) for r in records)


def _num_unmatched(records: Sequence[dict[str, Any]]) -> int:
    return sum(bool(r.get("unmatched_words")) for r in records)


def results(records: Sequence[dict[str, Any]], settings: Sequence[Setting]) -> dict[str, dict[str, dict[str, Any]]]:
    """part -> setting -> row, for the parts that ran."""
    out = {}
    for part in PARTS:
        rows = {s.name: part_row([r for r in records if r["part"] == part and r["setting"] == s.name]) for s in settings}
        if any(row["num_answers"] or row["num_errors"] for row in rows.values()):
            out[part] = rows
    return out


def paired_row(records: Sequence[dict[str, Any]], against: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One setting's right answers against another's on the same questions (and repeats): both asked, in
    scope and answered without error. Only the questions one gets right and the other wrong tell them
    apart; `p_value` is the exact two-sided sign test over those (McNemar's exact test): the chance of a
    split at least this uneven were both settings equally right. At 26 questions a few answers either way
    are within it."""
    def keyed(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
        return {(r["question"], r["repeat"]): r for r in rows if r["error"] is None and not r.get("out_of_scope")}

    mine, theirs = keyed(records), keyed(against)
    pairs = [(mine[k], theirs[k]) for k in mine.keys() & theirs.keys()]
    only_this = sum(a["right"] and not b["right"] for a, b in pairs)
    only_against = sum(b["right"] and not a["right"] for a, b in pairs)
    discordant = only_this + only_against
    return {
        "num_pairs": len(pairs), "both_right": sum(a["right"] and b["right"] for a, b in pairs),
        "only_this": only_this, "only_against": only_against,
        "neither": sum(not a["right"] and not b["right"] for a, b in pairs),
        "same_answer": sum(a["answer"] == b["answer"] for a, b in pairs),
        "p_value": float(binomtest(only_this, discordant, 0.5).pvalue) if discordant else 1.0,
    }


def paired(records: Sequence[dict[str, Any]], settings: Sequence[Setting]) -> dict[str, dict[str, Any]]:
    """part -> {"against": the first setting, "settings": every other setting -> its paired_row}."""
    if len(settings) < 2:
        return {}
    first, out = settings[0].name, {}
    for part in PARTS:
        in_part = [r for r in records if r["part"] == part]
        if not in_part:
            continue
        against = [r for r in in_part if r["setting"] == first]
        out[part] = {"against": first, "settings": {
            s.name: paired_row([r for r in in_part if r["setting"] == s.name], against) for s in settings[1:]}}
    return out


def _count(num: int, row: dict[str, Any], denominator: str = "num_answers") -> str:
    return f"{num}/{row[denominator]}" if row[denominator] else "-"


def print_tables(summary: dict[str, Any]) -> None:
    print(f"\nanswers bench: {summary['model']}, {len(summary['documents'])} documents, "
          f"max_tokens {summary['max_tokens'] or 'the server default'}, {summary['repeats']} repeat(s)")
    for part, rows in summary["results"].items():
        first = next(iter(rows.values()))
        print(f"\n{PARTS[part]} ({first['num_questions']} questions)")
        width = max(16, *(len(name) + 2 for name in rows))
        print(f"{'setting':<{width}}{'right':>8}{'inside':>8}{'right|in':>9}{'top src':>9}{'any src':>9}{'to cap':>8}"
              f"{'refused':>9}{'oos ok':>8}{'flagged':>9}{'right fl':>9}{'oos fl':>8}{'unmatch':>9}{'right um':>9}"
              f"{'oos um':>8}{'unwarned':>10}{'prompt':>8}{'TTFT p50':>10}{'errors':>8}")
        for name, row in rows.items():
            top = round((row["source_top"] or 0) * row["num_source_scored"])
            any_ = round((row["source_any"] or 0) * row["num_source_scored"])
            when_in = round((row["right_when_inside"] or 0) * row["num_inside"])
            ttft = f"{row['ttft_p50_ms']:.0f} ms" if row["ttft_p50_ms"] is not None else "-"
            prompt = f"{row['prompt_tokens_mean']:.0f}" if row["prompt_tokens_mean"] is not None else "-"
            print(f"{name:<{width}}{_count(row['num_right'], row):>8}{_count(row['num_inside'], row):>8}"
                  f"{_count(when_in, row, 'num_inside'):>9}{_count(top, row, 'num_source_scored'):>9}"
                  f"{_count(any_, row, 'num_source_scored'):>9}{_count(row['num_ran_to_cap'], row):>8}"
                  f"{_count(row['num_refused'], row):>9}{_count(row['num_oos_refused'], row, 'num_out_of_scope'):>8}"
                  f"{_count(row['num_flagged'], row):>9}{row['num_right_flagged']:>9}"
                  f"{_count(row['num_oos_flagged'], row, 'num_out_of_scope'):>8}"
                  f"{_count(row['num_unmatched'], row):>9}{row['num_right_unmatched']:>9}"
                  f"{_count(row['num_oos_unmatched'], row, 'num_out_of_scope'):>8}"
                  f"{_count(row['num_oos_unwarned'], row, 'num_out_of_scope'):>10}"
                  f"{prompt:>8}{ttft:>10}{row['num_errors']:>8}")
        pairs = summary.get("paired", {}).get(part)
        if pairs:
            print(f"paired against {pairs['against']} (right only here / only there, sign test p; answers alike):")
            for name, pair in pairs["settings"].items():
                print(f"  {name:<{width - 2}} +{pair['only_this']} / -{pair['only_against']}, p {pair['p_value']:.2f}; "
                      f"alike {pair['same_answer']}/{pair['num_pairs']}")


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
            documents = await upload_documents(client, qset, args.kv_timeout) if questions else {}
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
        print(f"ragblend bench answers: {exc}{hint}", file=sys.stderr)
        return ExitCode.USAGE
    if not questions and not musique:
        print("ragblend bench answers: no questions to ask", file=sys.stderr)
        return ExitCode.USAGE
    with contextlib.ExitStack() as stack:
        # One after the other: a server's loading planner times prefills while it starts, and a second
        # server starting meanwhile would slow those down.
        urls = {}
        for i, (key, group) in enumerate(server_groups(settings).items()):
            progress(f"starting a server for {', '.join(s.name for s in group)}")
            urls[key] = stack.enter_context(started_server(f"answers-{i}", group[0].server, args))
        try:
            measured = asyncio.run(measure(urls, settings, qset, questions, musique, args))
        except QueryFailed as exc:  # an upload, an ingest, a delete or a warm-up refused: nothing to score
            print(f"ragblend bench answers: {exc}", file=sys.stderr)
            return ExitCode.FAILED
    records = measured.pop("records")
    asked = Counter((q.document, q.split) for q in questions)
    summary = {
        "bench": "answers", "set": str(args.set), "model": measured["servers"][0]["model"], "split": args.split,
        "settings": [s.as_json() for s in settings], "repeats": args.repeats, "max_tokens": args.max_tokens,
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
