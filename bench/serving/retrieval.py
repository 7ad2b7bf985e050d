"""`ragblend bench retrieval`: retrieval's latency per ranking mode and store at a given number of chunks, with
its parts and the checks around it (docs/benchmarks/retrieval.md#latency-ragblend-bench-retrieval). Its
`--search-threads` and `--embedder-runtimes` variants were retired in issue 64 (`git show 66ac7e4:bench/serving/retrieval.py`)."""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from app.commands.exit_codes import ExitCode
from bench.harness.sets import DEFAULT_SET, load_set
from bench.harness.output import emit_summary, refuse
from bench.harness.postgres import empty_store, settle
from bench.harness.servers import REPO_ROOT as ROOT
from bench.harness.stats import in_turn, percentiles, timed_ms as timed
from configs.enums import RetrievalMode

CHUNKS_PER_DOCUMENT = 10
ALL = ("default",)  # the one collection the chunks go into (retrieval.store_types.DEFAULT_COLLECTION)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n\s*\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chunks", type=int, default=10_000, help="chunks in the store")
    parser.add_argument("--queries", type=int, default=300, help="questions timed per mode (after a warm-up of 20)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--num-candidates", type=int, default=20, help="hybrid: each ranking's depth")
    parser.add_argument("--modes", default="dense,lexical,hybrid")
    parser.add_argument("--database-url", help="also measure a Postgres store here (an empty database: its tables "
                        "are dropped first)")
    parser.add_argument("--random-vectors", action="store_true",
                        help="random unit vectors instead of embedding every chunk (quicker to build; dense "
                             "search costs the same)")
    parser.add_argument("--musique-data", type=Path, default=Path("../shared/data/musique_dev.json"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)


def sentences(musique: Path) -> list[str]:
    """Every sentence of the corpus sources (those present), de-duplicated, in a stable order."""
    texts: list[str] = []
    if musique.is_file():
        texts += [c["text"] for item in json.loads(musique.read_text()) for c in item["ctxs"]]
    for path in sorted((ROOT / "bench" / "data" / "answers" / "docs").glob("*")):
        if path.suffix in (".txt", ".md"):
            texts.append(path.read_text(errors="replace"))
    texts += [p.read_text() for p in sorted((ROOT / "docs").rglob("*.md"))]
    out = dict.fromkeys(" ".join(s.split()) for t in texts for s in _SENTENCE_END.split(t))
    return [s for s in out if 20 <= len(s) <= 400]


def questions(musique: Path) -> list[str]:
    out = [q.question for q in load_set(DEFAULT_SET).questions]
    if musique.is_file():
        out += [item["question"] for item in json.loads(musique.read_text())]
    return out


def chunk_texts(pool: Sequence[str], num_chunks: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.sample(pool, rng.randint(3, 8))) for _ in range(num_chunks)]


def fill(retriever, texts: Sequence[str], random_vectors: bool, rng: random.Random) -> float:
    """Write the chunks through the store (10 a document) and the index; seconds taken."""
    from retrieval.store_types import NewChunk

    start = time.perf_counter()
    for first in range(0, len(texts), CHUNKS_PER_DOCUMENT):
        part = texts[first : first + CHUNKS_PER_DOCUMENT]
        if random_vectors:
            vectors = np.asarray([rng.gauss(0, 1) for _ in range(len(part) * retriever.embedder.dim)], np.float32)
            vectors = vectors.reshape(len(part), -1)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        else:
            vectors = retriever.embedder.encode(part)
        result = retriever.store.put_document(f"doc-{first // CHUNKS_PER_DOCUMENT}", None, {}, sum(map(len, part)),
                                              [NewChunk(t, (1,), v) for t, v in zip(part, vectors)])
        retriever.follow([], result.document.chunks, list(vectors))
    retriever.index.save()
    return time.perf_counter() - start


def _stats(samples_ms: Sequence[float]) -> dict[str, float]:
    return {**percentiles(samples_ms), "max_ms": max(samples_ms)}


def measure(retriever, asked: Sequence[str], modes: Sequence[RetrievalMode], top_k: int, num_candidates: int,
            rrf_k: int, num_queries: int) -> dict[str, Any]:
    """Per mode (the modes taking turns per question): the whole search as the server runs it, the same given
    the embedding, and with both checks' lookup beside it (as the server retrieves); then the parts alone."""
    kinds = ("search", "search_after_embedding", "search_checked")
    samples: dict[str, dict[str, list[float]]] = {kind: {m.value: [] for m in modes} for kind in kinds}
    parts: dict[str, list[float]] = {name: [] for name in ("embed", "dense_index", "lexical_store",
                                                           "unmentioned_names", "unmatched_words")}
    for number in range(num_queries + 20):
        question, is_warm = asked[number % len(asked)], number >= 20
        vector = retriever.embedder.encode_one(question)
        for mode in in_turn(modes, number):
            took = (timed(lambda: retriever.search(question, top_k, ALL, mode, num_candidates, rrf_k)),
                    timed(lambda: retriever.search(question, top_k, ALL, mode, num_candidates, rrf_k, vector=vector)),
                    timed(lambda: retriever.checked_search(question, top_k, ALL, mode, num_candidates, rrf_k,
                                                           names=True, words=True)))
            for kind, ms in zip(kinds, took):
                if is_warm:
                    samples[kind][mode.value].append(ms)
        # each part alone; the server's checks: retrieval.refuse_unmentioned_names (the named words' parts) and
        # retrieval.flag_unmatched_words (every question word), looked up in one call beside its ranking
        took = (timed(lambda: retriever.embedder.encode_one(question)),
                timed(lambda: retriever.index.search(vector, max(top_k, num_candidates), ALL)),
                timed(lambda: retriever.store.lexical_search(question, max(top_k, num_candidates), ALL)),
                timed(lambda: retriever.question_words(question, ALL, words=False)),
                timed(lambda: retriever.question_words(question, ALL, names=False)))
        for name, ms in zip(parts, took):
            if is_warm:
                parts[name].append(ms)
    return {**{kind: {mode: _stats(s) for mode, s in by_mode.items()} for kind, by_mode in samples.items()},
            "parts": {name: _stats(s) for name, s in parts.items()}}


def run_store(database_url: str | None, texts: Sequence[str], asked: Sequence[str], args) -> dict[str, Any]:
    """The measurement over a store filled with `texts`: SQLite, or Postgres at `database_url`."""
    from retrieval.config import RetrievalConfig
    from retrieval.retriever import Retriever

    with tempfile.TemporaryDirectory(prefix="ragblend-retrieval-bench-") as tmp:
        config = RetrievalConfig()
        retriever = Retriever.open(Path(tmp), config, empty_store(database_url))
        try:
            fill_s = fill(retriever, texts, args.random_vectors, random.Random(args.seed))
            if database_url:
                settle(database_url)
            modes = [RetrievalMode(m.strip()) for m in args.modes.split(",")]
            result = measure(retriever, asked, modes, args.top_k, args.num_candidates, config.rrf_k, args.queries)
            return {"store": "postgres" if database_url else "sqlite", "num_chunks": retriever.store.num_chunks(),
                    "fill_s": fill_s, **result}
        finally:
            retriever.close()


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    """Per store: each mode's whole search (the question's embedding included), the same given the
    embedding (the indexes, the fusion, the chunks' rows), and the parts."""
    print(f"\n{'store':<10}{'chunks':>8}  {'what':<26}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}")
    for row in rows:
        lines = [*row["search"].items(), *((f"{k} (embedded)", v) for k, v in row["search_after_embedding"].items()),
                 *((f"{k} (checked)", v) for k, v in row["search_checked"].items()),
                 *((f"  {k}", v) for k, v in row["parts"].items())]
        for name, stats in lines:
            print(f"{row['store']:<10}{row['num_chunks']:>8}  {name:<26}{stats['p50_ms']:>9.2f}{stats['p99_ms']:>9.2f}"
                  f"{stats['max_ms']:>9.2f}")


def run(args: argparse.Namespace) -> int:
    if args.chunks < 1 or args.queries < 1:
        return refuse("retrieval", "--chunks and --queries must be >= 1", ExitCode.USAGE)
    rng = random.Random(args.seed)
    texts = chunk_texts(sentences(args.musique_data), args.chunks, rng)
    asked = questions(args.musique_data)
    rows = [run_store(None, texts, asked, args)]  # SQLite, then the same on Postgres where given
    if args.database_url:
        rows.append(run_store(args.database_url, texts, asked, args))
    print_table(rows)
    emit_summary({"bench": "retrieval", "chunks": args.chunks, "queries": args.queries, "top_k": args.top_k,
                  "num_candidates": args.num_candidates, "random_vectors": args.random_vectors, "seed": args.seed,
                  "num_questions": len(asked), "results": rows}, args.out, indent=2)
    return ExitCode.OK
