"""`ragblend bench replicas`: what the shared Postgres store costs, side by side in one run.

Three live servers in this process share one loaded engine (so they differ only in their store):
`sqlite` (the embedded default), `pg-a` and `pg-b` (one Postgres database, each its own index that
follows it). The MuSiQue passages are ingested into `sqlite` and `pg-a`, alternating per question
(documents/s per store); while `pg-a` ingests, a watcher polls `pg-b`'s index every millisecond, so
each document's change propagation is the time from its commit in Postgres to its chunks being in
`pg-b`'s index. Then each question is asked through `sqlite` and `pg-a` in alternating order, with
retrieval (top_k, so the store's reads are in the path), streaming: end-to-end TTFT (request sent to
first token) and the server's own TTFT. Prints a table, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

import httpx

from app.commands.ask import iter_events
from bench.harness.args import add_data, add_out
from bench.harness.data import Question, load_questions
from bench.harness.output import emit_summary

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


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


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


def _ingest(http: httpx.Client, qi: int, question: Question) -> tuple[float, list[str]]:
    docs = [{"id": f"q{qi}p{pi}", "text": text} for pi, text in enumerate(question.passages)]
    start = time.perf_counter()
    response = http.post("/v1/documents", json={"documents": docs, "chunking": "none", "precompute": True})
    response.raise_for_status()
    return time.perf_counter() - start, [d["id"] for d in docs]


def _ask(http: httpx.Client, question: str, args: argparse.Namespace) -> tuple[float, float]:
    # the prefix cache off: a question asked again (the warm-up's) would be served from it
    body = {"question": question, "top_k": args.top_k, "mode": args.mode, "max_tokens": args.max_tokens,
            "stream": True, "prefix_cache": False}
    sent, first, lines = time.perf_counter(), None, []
    with http.stream("POST", "/v1/query", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("event: token") and first is None:
                first = time.perf_counter()
            lines.append(line)
    done = next((data for kind, data in iter_events(lines) if kind == "done"), {})
    first = first or time.perf_counter()
    return (first - sent) * 1000, done.get("timings", {}).get("ttft_ms", 0.0)


def bench(args: argparse.Namespace, questions: list[Question]) -> dict:
    import psycopg

    from app.testing import LiveServer
    from blend_engine.engine import BlendEngine
    from configs.settings import load_settings

    base = load_settings(args.config)
    engine = BlendEngine.from_config(base.model, base.blend)
    with tempfile.TemporaryDirectory(prefix="ragblend-bench-replicas-") as tmp:
        def settings(name: str, database_url: str | None):
            return base.model_copy(update={"data_dir": Path(tmp) / name,
                                           "database": replace(base.database, url=database_url)})

        with LiveServer(settings("sqlite", None), engine) as sqlite_server, \
                LiveServer(settings("pg-a", args.database_url), engine) as pg_a, \
                LiveServer(settings("pg-b", args.database_url), engine) as pg_b, \
                httpx.Client(base_url=sqlite_server.url, timeout=600) as sqlite_http, \
                httpx.Client(base_url=pg_a.url, timeout=600) as pg_http, \
                psycopg.connect(args.database_url) as conn:
            clients = {"sqlite": sqlite_http, "pg": pg_http}
            ingest_s = {store: 0.0 for store in STORES}
            propagation_ms: list[float] = []
            with IndexWatcher(pg_b.components.retriever) as watcher:
                for qi, question in enumerate(questions):
                    order = STORES if qi % 2 == 0 else STORES[::-1]
                    for store in order:
                        seconds, doc_ids = _ingest(clients[store], qi, question)
                        ingest_s[store] += seconds
                        if store == "pg":
                            propagation_ms += _propagation_ms(conn, pg_a, watcher, doc_ids)
                    print(f"ingested question {qi + 1}/{len(questions)}'s passages", file=sys.stderr, flush=True)
            _ask(sqlite_http, questions[0].question, args)  # warm-up, both
            _ask(pg_http, questions[0].question, args)
            ttft = {store: {"e2e": [], "server": []} for store in STORES}
            for rnd in range(args.rounds):
                for qi, question in enumerate(questions):
                    order = STORES if (qi + rnd) % 2 == 0 else STORES[::-1]
                    for store in order:
                        e2e, server = _ask(clients[store], question.question, args)
                        ttft[store]["e2e"].append(e2e)
                        ttft[store]["server"].append(server)
                print(f"round {rnd + 1}/{args.rounds} asked", file=sys.stderr, flush=True)
    num_docs = sum(len(q.passages) for q in questions)
    rows = {store: {"median_e2e_ttft_ms": median(ttft[store]["e2e"]),
                    "median_server_ttft_ms": median(ttft[store]["server"]),
                    "ingest_docs_per_s": num_docs / ingest_s[store]} for store in STORES}
    ratio = rows["pg"]["median_e2e_ttft_ms"] / rows["sqlite"]["median_e2e_ttft_ms"]
    return {
        "bench": "replicas", "model": engine.model_name, "questions": len(questions), "passages": args.passages,
        "rounds": args.rounds, "top_k": args.top_k, "mode": args.mode, "max_tokens": args.max_tokens,
        "results": rows, "pg_vs_sqlite_e2e_ttft_ratio": ratio, "target_ratio": 1.05, "is_target_met": ratio <= 1.05,
        "propagation_ms": {"p50": _percentile(propagation_ms, 0.5), "p99": _percentile(propagation_ms, 0.99),
                           "max": max(propagation_ms), "num": len(propagation_ms)},
    }


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


def print_table(summary: dict) -> None:
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


def run(args: argparse.Namespace) -> int:
    questions = load_questions(args.data, args.questions, args.passages)
    summary = bench(args, questions)
    print_table(summary)
    emit_summary(summary, args.out, indent=2)
    return 0
