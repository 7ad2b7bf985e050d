"""`ragblend bench replicas`: the Postgres store against SQLite in one run, three live servers sharing one engine:
query TTFT, ingest, change propagation to a second replica's index (docs/benchmarks/replicas.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

import httpx

from bench.harness.args import add_data, add_out
from bench.harness.client import ingest, stream_query
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary
from bench.harness.stats import in_turn, percentile

STORES = ("sqlite", "pg")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--database-url", required=True, help="postgresql://... of an empty database (the bench's "
                        "documents are written there)")
    parser.add_argument("--config", type=Path, default=None, help="settings YAML (default: the embedded SmolLM2)")
    add_data(parser, questions=10)
    parser.add_argument("--rounds", type=int, default=3, help="times each question is asked through each store")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--mode", default="blend")
    add_out(parser)


class IndexWatcher:
    """Records when each row id first appears in a server's index (polled every millisecond)."""

    def __init__(self, retriever):
        self._retriever, self.seen, self._stop = retriever, {}, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> IndexWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for row_id in self._retriever.index.ids().tolist():
                self.seen.setdefault(row_id, now)
            time.sleep(0.001)


def _propagation_ms(conn, pg_a, watcher: IndexWatcher, doc_ids: list[str]) -> list[float]:
    """Per document: its commit in Postgres (the change row's time) to its last chunk in pg-b's index."""
    out = []
    store = pg_a.components.retriever.store
    for doc_id in doc_ids:
        row_ids = [c.row_id for c in store.get_document(doc_id).chunks]
        committed_at = conn.execute("SELECT committed_at FROM changes WHERE document_id = %s ORDER BY seq DESC"
                                    " LIMIT 1", (doc_id,)).fetchone()[0]
        conn.commit()
        deadline = time.monotonic() + 30
        while not all(r in watcher.seen for r in row_ids):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{doc_id} did not reach pg-b's index within 30 s")
            time.sleep(0.001)
        out.append((max(watcher.seen[r] for r in row_ids) - committed_at) * 1000)
    return out


async def _ask(urls: dict[str, str], questions: list[Question], args: argparse.Namespace) -> dict:
    """Every question through both stores, the order alternating; the prefix cache off (the warm-up asks one)."""
    clients = {store: httpx.AsyncClient(base_url=url, timeout=600) for store, url in urls.items()}
    ttft: dict[str, dict[str, list[float]]] = {store: {"e2e": [], "server": []} for store in STORES}

    def body(question: Question) -> dict:
        return {"question": question.question, "top_k": args.top_k, "mode": args.mode, "max_tokens": args.max_tokens,
                "prefix_cache": False}

    try:
        for client in clients.values():
            await stream_query(client, body(questions[0]))
        for rnd in range(args.rounds):
            for qi, question in enumerate(questions):
                for store in in_turn(STORES, qi + rnd):
                    answer = await stream_query(clients[store], body(question))
                    ttft[store]["e2e"].append(answer.ttft_ms)
                    ttft[store]["server"].append(answer.timings.get("ttft_ms", 0.0))
            print(f"round {rnd + 1}/{args.rounds} asked", file=sys.stderr, flush=True)
    finally:
        for client in clients.values():
            await client.aclose()
    return ttft


def bench(args: argparse.Namespace, questions: list[Question]) -> dict:
    import psycopg

    from app.testing import LiveServer
    from blend_engine.engine import BlendEngine
    from configs.settings import load_settings

    base = load_settings(args.config)
    engine = BlendEngine.from_config(base.model, base.blend)
    with tempfile.TemporaryDirectory(prefix="ragblend-bench-replicas-") as tmp:
        def live(name: str, database_url: str | None) -> LiveServer:
            return LiveServer(base.model_copy(update={"data_dir": Path(tmp) / name, "database": replace(
                base.database, url=database_url)}), engine)

        with live("sqlite", None) as sqlite_server, live("pg-a", args.database_url) as pg_a, \
                live("pg-b", args.database_url) as pg_b, psycopg.connect(args.database_url) as conn:
            urls = {"sqlite": sqlite_server.url, "pg": pg_a.url}
            ingest_s = {store: 0.0 for store in STORES}
            propagation_ms: list[float] = []
            with IndexWatcher(pg_b.components.retriever) as watcher:
                for qi, question in enumerate(questions):
                    for store in in_turn(STORES, qi):
                        with httpx.Client(base_url=urls[store], timeout=600) as http:
                            ingest_s[store] += ingest(http, [question], first=qi)
                        if store == "pg":
                            doc_ids = [f"q{qi}p{pi}" for pi in range(len(question.passages))]
                            propagation_ms += _propagation_ms(conn, pg_a, watcher, doc_ids)
            ttft = asyncio.run(_ask(urls, questions, args))
    num_docs = sum(len(q.passages) for q in questions)
    rows = {store: {"median_e2e_ttft_ms": median(ttft[store]["e2e"]),
                    "median_server_ttft_ms": median(ttft[store]["server"]),
                    "ingest_docs_per_s": num_docs / ingest_s[store]} for store in STORES}
    ratio = rows["pg"]["median_e2e_ttft_ms"] / rows["sqlite"]["median_e2e_ttft_ms"]
    return {
        "bench": "replicas", "model": engine.model_name, "questions": len(questions), "passages": args.passages,
        "rounds": args.rounds, "top_k": args.top_k, "mode": args.mode, "max_tokens": args.max_tokens,
        "results": rows, "pg_vs_sqlite_e2e_ttft_ratio": ratio, "target_ratio": 1.05, "is_target_met": ratio <= 1.05,
        "propagation_ms": {"p50": percentile(propagation_ms, 50), "p99": percentile(propagation_ms, 99),
                           "max": max(propagation_ms), "num": len(propagation_ms)},
    }


def run(args: argparse.Namespace) -> int:
    summary = bench(args, load_questions(args.data, args.questions, args.passages))
    print(f"\nreplicas bench: {summary['model']}, {summary['questions']} questions x {summary['passages']} passages, "
          f"{summary['rounds']} rounds, top_k {summary['top_k']}, mode {summary['mode']}, "
          f"max_tokens {summary['max_tokens']}")
    print(f"{'store':<8}{'e2e TTFT ms':>13}{'server TTFT ms':>16}{'ingest docs/s':>15}")
    for store, r in summary["results"].items():
        print(f"{store:<8}{r['median_e2e_ttft_ms']:>13.1f}{r['median_server_ttft_ms']:>16.1f}"
              f"{r['ingest_docs_per_s']:>15.2f}")
    p = summary["propagation_ms"]
    print(f"Postgres / SQLite e2e TTFT: {summary['pg_vs_sqlite_e2e_ttft_ratio']:.3f} (target <= 1.05)")
    print(f"change propagation pg-a -> pg-b index: p50 {p['p50']:.1f} ms, p99 {p['p99']:.1f} ms, "
          f"max {p['max']:.1f} ms over {p['num']} documents")
    emit_summary(summary, args.out, indent=2)
    return 0
