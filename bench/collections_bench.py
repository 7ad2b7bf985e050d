"""Retrieval scoped to a request's collections: one FAISS index searched with a filter (the collection's
row ids as an IDSelector) against one index per collection (searched alone; several merged by score).

Random unit vectors of the embedder's dimension (384, MiniLM) stand for chunk embeddings: search cost
depends on the counts and the dimension, not on what the vectors mean. Two layouts: many small
collections (`--collections 200 --chunks 500`) and one large one (`--collections 1 --chunks 100000`);
per layout and way, the p50 and p99 of one query's search time over `--queries` queries, on one thread
(the server's query thread runs FAISS on one thread), plus the same for a query over 3 collections.

    python -m bench.collections_bench --collections 200 --chunks 500
    python -m bench.collections_bench --collections 1 --chunks 100000
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import faiss
import numpy as np

from bench.harness.output import emit_summary
from configs.enums import IndexKind

DIM = 384  # all-MiniLM-L6-v2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--collections", type=int, default=200)
    parser.add_argument("--chunks", type=int, default=500, help="chunks per collection")
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--index", choices=[k.value for k in IndexKind], default=IndexKind.FLAT.value)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)


def unit_vectors(rng: np.random.Generator, n: int) -> np.ndarray:
    vectors = rng.standard_normal((n, DIM)).astype(np.float32)  # [n, DIM]
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def new_index(kind: IndexKind) -> faiss.Index:
    base = faiss.IndexHNSWFlat(DIM, 32, faiss.METRIC_INNER_PRODUCT) if kind is IndexKind.HNSW else faiss.IndexFlatIP(DIM)
    if kind is IndexKind.HNSW:
        base.hnsw.efSearch = 64
    return faiss.IndexIDMap2(base)


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ms = np.array(samples_s) * 1000
    return {"p50_ms": round(float(np.percentile(ms, 50)), 4), "p99_ms": round(float(np.percentile(ms, 99)), 4)}


def run(args: argparse.Namespace) -> int:
    faiss.omp_set_num_threads(1)
    kind, rng = IndexKind(args.index), np.random.default_rng(args.seed)
    num_total = args.collections * args.chunks
    vectors = unit_vectors(rng, num_total)
    ids = np.arange(1, num_total + 1, dtype=np.int64)
    # row ids interleaved across collections, as ingests into several collections commit them
    owner = rng.integers(0, args.collections, num_total) if args.collections > 1 else np.zeros(num_total, np.int64)
    members = [ids[owner == c] for c in range(args.collections)]

    t0 = time.perf_counter()
    one = new_index(kind)
    one.add_with_ids(vectors, ids)
    build_one_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    shards = []
    for c in range(args.collections):
        shard = new_index(kind)
        shard.add_with_ids(vectors[owner == c], members[c])
        shards.append(shard)
    build_shards_s = time.perf_counter() - t0
    selectors = [faiss.IDSelectorBatch(m) for m in members]  # built once per collection, as a server would cache

    queries = unit_vectors(rng, args.queries)
    picks = rng.integers(0, args.collections, (args.queries, 3))
    timings: dict[str, list[float]] = {"filtered_1": [], "sharded_1": [], "filtered_3": [], "sharded_3": []}
    for query, pick in zip(queries, picks):
        q = query.reshape(1, -1)
        c = int(pick[0])
        t = time.perf_counter()
        params = faiss.SearchParametersHNSW(sel=selectors[c]) if kind is IndexKind.HNSW else faiss.SearchParameters(sel=selectors[c])
        one.search(q, args.top_k, params=params)
        timings["filtered_1"].append(time.perf_counter() - t)
        t = time.perf_counter()
        shards[c].search(q, min(args.top_k, shards[c].ntotal))
        timings["sharded_1"].append(time.perf_counter() - t)
        chosen = sorted(set(int(p) for p in pick))
        t = time.perf_counter()
        union = faiss.IDSelectorBatch(np.concatenate([members[p] for p in chosen]))
        params = faiss.SearchParametersHNSW(sel=union) if kind is IndexKind.HNSW else faiss.SearchParameters(sel=union)
        one.search(q, args.top_k, params=params)
        timings["filtered_3"].append(time.perf_counter() - t)
        t = time.perf_counter()
        hits = []
        for p in chosen:
            scores, found = shards[p].search(q, min(args.top_k, shards[p].ntotal))
            hits += zip(scores[0].tolist(), found[0].tolist())
        sorted(hits, reverse=True)[: args.top_k]
        timings["sharded_3"].append(time.perf_counter() - t)
    summary = {
        "bench": "collections", "index": kind.value, "collections": args.collections, "chunks_per_collection":
        args.chunks, "dim": DIM, "queries": args.queries, "top_k": args.top_k, "threads": 1,
        "machine": platform.machine(), "build_s": {"one": round(build_one_s, 3), "sharded": round(build_shards_s, 3)},
        **{name: percentiles(samples) for name, samples in timings.items()},
    }
    emit_summary(summary, args.out, indent=2)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
