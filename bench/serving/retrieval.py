"""`ragblend bench retrieval`: how long retrieval takes per ranking mode (dense, lexical, hybrid) and store
(SQLite, Postgres with --database-url) at a given number of chunks; p50 and p99 per mode, with its parts
(embedding the question, the FAISS search, the full-text search) and the checks that run before any
ranking (the names no chunk mentions, retrieval.refuse_unmentioned_names) and after it (the question's words
no chunk holds, retrieval.flag_unmatched_words).

The chunks are real-ish text: sentences of the MuSiQue passages (Wikipedia), of the answers bench's
documents (man pages, configuration files, FAQs) and of this project's docs, drawn at random (seeded)
into chunks of 3 to 8 sentences, embedded by the server's embedder (or random unit vectors with
--random-vectors: the dense search's cost does not depend on their values), and written through the
store's own put_document (chunks and their lexical rows in one transaction), 10 chunks a document.
The questions are real ones (MuSiQue's and the answers bench's), asked in turn after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from app.commands.exit_codes import ExitCode
from bench.harness.sets import DEFAULT_SET, load_set
from bench.harness.output import emit_summary
from bench.harness.postgres import empty_database, settle
from bench.harness.servers import REPO_ROOT
from configs.enums import EmbedderRuntime, RetrievalMode

if TYPE_CHECKING:
    from retrieval.embedder import Embedder

ROOT = REPO_ROOT
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
    parser.add_argument("--search-threads", default=None,
                        help="FAISS threads of a search (retrieval.search_threads); several, comma-separated "
                             "(e.g. 1,2): each mode is timed under each in turn, reported as MODE@N")
    parser.add_argument("--embedder-runtimes", default=None,
                        help="what runs the question's embedding (retrieval.embedder_runtime): several, "
                             "comma-separated (e.g. torch,onnx): each mode is timed under each in turn, reported "
                             "as MODE/RUNTIME")
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


def percentiles(samples_ms: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_ms)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"p50_ms": statistics.median(ordered), "p99_ms": p99, "max_ms": ordered[-1], "n": len(ordered)}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def measure(retriever, asked: Sequence[str], modes: Sequence[RetrievalMode], top_k: int, num_candidates: int,
            rrf_k: int, num_queries: int, search_threads: Sequence[int] = (),
            embedders: dict[str, Embedder] | None = None) -> dict[str, Any]:
    """Per mode: the whole search (as the server runs it, hybrid fusing by `rrf_k`: the retriever's
    config's), and its parts, the modes taking turns per question;
    with several `search_threads`, each mode under each FAISS thread count in turn (keys MODE@N); with
    several `embedders` (runtime -> Embedder), each under each in turn (keys MODE/RUNTIME, parts embed/RUNTIME)."""
    embedders = embedders if embedders and len(embedders) > 1 else {None: retriever.embedder}
    runs = [(m, n, e) for m in modes for n in (search_threads if len(search_threads) > 1 else [None])
            for e in embedders]
    names = {run: run[0].value + ("" if run[1] is None else f"@{run[1]}") + ("" if run[2] is None else f"/{run[2]}")
             for run in runs}
    samples: dict[str, list[float]] = {name: [] for name in names.values()}
    after_embedding: dict[str, list[float]] = {name: [] for name in names.values()}
    checked: dict[str, list[float]] = {name: [] for name in names.values()}
    embed_parts = {e: "embed" if e is None else f"embed/{e}" for e in embedders}
    parts: dict[str, list[float]] = {**{name: [] for name in embed_parts.values()},
                                     "dense_index": [], "lexical_store": [], "unmentioned_names": [],
                                     "unmatched_words": []}
    threads_set, embedder_set = retriever.index.search_threads, retriever.embedder
    for number in range(num_queries + 20):
        question = asked[number % len(asked)]
        is_warm = number >= 20
        vector = embedder_set.encode_one(question)
        for mode, threads, runtime in runs[number % len(runs):] + runs[: number % len(runs)]:
            retriever.index.search_threads = threads_set if threads is None else threads
            retriever.embedder = embedders[runtime]
            took = timed(lambda: retriever.search(question, top_k, ALL, mode, num_candidates, rrf_k))
            given = timed(lambda: retriever.search(question, top_k, ALL, mode, num_candidates, rrf_k, vector=vector))
            # as the server retrieves: the search with both checks' lookup beside it
            whole = timed(lambda: retriever.checked_search(question, top_k, ALL, mode, num_candidates, rrf_k,
                                                           names=True, words=True))
            if is_warm:
                samples[names[mode, threads, runtime]].append(took)
                after_embedding[names[mode, threads, runtime]].append(given)
                checked[names[mode, threads, runtime]].append(whole)
        retriever.index.search_threads, retriever.embedder = threads_set, embedder_set
        embeds = {name: timed(lambda: embedders[e].encode_one(question)) for e, name in embed_parts.items()}
        dense = timed(lambda: retriever.index.search(vector, max(top_k, num_candidates), ALL))
        lexical = timed(lambda: retriever.store.lexical_search(question, max(top_k, num_candidates), ALL))
        # the server's checks, each alone (retrieval.refuse_unmentioned_names: the named words' parts;
        # retrieval.flag_unmatched_words: every question word); the server looks both up in one call beside
        # its ranking (`checked`, above)
        unmentioned = timed(lambda: retriever.question_words(question, ALL, words=False))
        unmatched = timed(lambda: retriever.question_words(question, ALL, names=False))
        if is_warm:
            parts["unmentioned_names"].append(unmentioned)
            parts["unmatched_words"].append(unmatched)
            for name, took in embeds.items():
                parts[name].append(took)
            parts["dense_index"].append(dense)
            parts["lexical_store"].append(lexical)
    return {"search": {mode: percentiles(s) for mode, s in samples.items()},
            "search_after_embedding": {mode: percentiles(s) for mode, s in after_embedding.items()},
            "search_checked": {mode: percentiles(s) for mode, s in checked.items()},
            "parts": {name: percentiles(s) for name, s in parts.items()}}


def run_store(kind: str, database_url: str | None, texts: Sequence[str], asked: Sequence[str], args) -> dict[str, Any]:
    from retrieval.config import RetrievalConfig
    from retrieval.embedder import Embedder
    from retrieval.retriever import Retriever

    with tempfile.TemporaryDirectory(prefix="ragblend-retrieval-bench-") as tmp:
        store = None
        if kind == "postgres":
            from retrieval.pg_store import PostgresDocumentStore

            empty_database(database_url)
            store = PostgresDocumentStore(database_url)
        threads, runtimes = _threads(args.search_threads), _runtimes(args.embedder_runtimes)
        config = RetrievalConfig(**({"search_threads": threads[0]} if threads else {}),
                                 **({"embedder_runtime": runtimes[0]} if runtimes else {}))
        retriever = Retriever.open(Path(tmp), config, store)
        try:
            embedders = {r.value: retriever.embedder if r is config.embedder_runtime else Embedder.from_name(
                config.embedder, runtime=r, cache_dir=config.embedder_cache_dir) for r in runtimes}
            fill_s = fill(retriever, texts, args.random_vectors, random.Random(args.seed))
            if kind == "postgres":
                settle(database_url)
            modes = [RetrievalMode(m.strip()) for m in args.modes.split(",")]
            result = measure(retriever, asked, modes, args.top_k, args.num_candidates, config.rrf_k, args.queries,
                             threads, embedders)
            return {"store": kind, "num_chunks": retriever.store.num_chunks(), "fill_s": fill_s, **result}
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
        print("ragblend bench retrieval: --chunks and --queries must be >= 1", file=sys.stderr)
        return ExitCode.USAGE
    try:
        _runtimes(args.embedder_runtimes)
    except ValueError:
        print(f"ragblend bench retrieval: --embedder-runtimes takes {', '.join(r.value for r in EmbedderRuntime)}",
              file=sys.stderr)
        return ExitCode.USAGE
    rng = random.Random(args.seed)
    texts = chunk_texts(sentences(args.musique_data), args.chunks, rng)
    asked = questions(args.musique_data)
    rows = [run_store("sqlite", None, texts, asked, args)]
    if args.database_url:
        rows.append(run_store("postgres", args.database_url, texts, asked, args))
    print_table(rows)
    emit_summary({"bench": "retrieval", "chunks": args.chunks, "queries": args.queries, "top_k": args.top_k,
                  "search_threads": _threads(args.search_threads) or None,
                  "embedder_runtimes": [r.value for r in _runtimes(args.embedder_runtimes)] or None,
                  "num_candidates": args.num_candidates, "random_vectors": args.random_vectors, "seed": args.seed,
                  "num_questions": len(asked), "results": rows}, args.out, indent=2)
    return ExitCode.OK


def _threads(text: str | None) -> list[int]:
    return [] if not text else [int(x) for x in text.split(",") if x.strip()]


def _runtimes(text: str | None) -> list[EmbedderRuntime]:
    return [] if not text else [EmbedderRuntime(x.strip()) for x in text.split(",") if x.strip()]
