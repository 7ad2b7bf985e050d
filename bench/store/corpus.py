"""`ragblend bench corpus`: the collection's KV budget at corpus scale. A synthetic collection (random KV of a
tiny model's shape: hit rates do not depend on its values) is ingested into a real KVStore under each
budget, then a Zipf stream of questions asks for each document's chunks as the server does; each question's
TTFT is the real model's, measured through the server's prefill executor per number of chunks missing
(docs/benchmarks/corpus.md)."""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from statistics import mean, median

import numpy as np
import torch

from bench.harness.args import add_out
from bench.harness.engine import load_engine
from bench.harness.output import emit_summary
from blend_engine.config import ModelConfig
from blend_engine.engine import BlendEngine
from blend_engine.kv import ChunkKV, KVShape
from blend_engine.types import SamplingParams
from configs.enums import RequestMode
from configs.settings import load_settings
from kv_store import Admission, KVStore
from runtime.executor import PrefillExecutor
from runtime.types import PrefillRequest, PromptChunk


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=2000)
    parser.add_argument("--doc-tokens", type=int, default=1536)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--questions", type=int, default=4000, help="questions in the Zipf stream")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf exponent of document popularity")
    parser.add_argument("--budgets", default="0.1,0.3,1.0", help="KV budgets, shares of the collection's KV")
    parser.add_argument("--collection-model", default="random:tiny-llama")
    parser.add_argument("--collection-kv", default="random", choices=["random", "model"],
                        help="the collection's KV values: random tensors of the model's KV shape, or computed by it")
    parser.add_argument("--ttft-model", default=None, help="model TTFT is measured with (default: settings')")
    parser.add_argument("--ttft-repeats", type=int, default=3)
    parser.add_argument("--mode", default="auto", choices=[m.value for m in RequestMode],
                        help="the TTFT step's request mode (auto: the server's default)")
    parser.add_argument("--smollm2-bytes-per-token", type=float, default=None,
                        help="bytes at rest per token of the real model's KV in this format (docs/benchmarks/kv-codec.md)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    add_out(parser)


def _chunk_ids(doc: int, num_chunks: int, chunk_tokens: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    rng = np.random.default_rng((seed, doc))
    ids = rng.integers(3, vocab, size=(num_chunks, chunk_tokens))
    return [tuple(int(t) for t in row) for row in ids]


class Collection:
    """Documents as chunks of token ids (generated from the seed, never all held) and their KV."""

    def __init__(self, engine: BlendEngine, args: argparse.Namespace):
        self.engine, self.args = engine, args
        self.num_chunks = -(-args.doc_tokens // args.chunk_tokens)
        self.vocab = 256  # every random shape has at least this many token ids
        self.context_ids = ()

    def chunks(self, doc: int) -> list[tuple[int, ...]]:
        return _chunk_ids(doc, self.num_chunks, self.args.chunk_tokens, self.vocab, self.args.seed)

    def kv(self, token_ids: tuple[int, ...]):
        if self.args.collection_kv == "model":
            return self.engine.precompute(list(token_ids), self.context_ids)
        g = torch.Generator().manual_seed(hash(token_ids[:16]) & 0x7FFFFFFF)
        shape = (self.engine.num_layers, self.engine.num_kv_heads, len(token_ids), self.engine.head_dim)
        return ChunkKV(tuple(token_ids), self.context_ids, torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def _store(root: Path, fingerprint: str, shape: KVShape, budget_bytes: int) -> KVStore:
    config = replace(load_settings().store, max_memory_bytes=0, disk_dir=root, max_disk_bytes=budget_bytes,
                     fsync=False, redis_url=None)
    return KVStore(fingerprint, config, shape=shape)


def ingest(store: KVStore, collection: Collection) -> dict:
    """As the document writer does: each chunk precomputed while the budget has room."""
    t0 = time.perf_counter()
    num_written = 0
    for doc in range(collection.args.documents):
        for ids in collection.chunks(doc):
            key = store.key_for(ids)
            if store.should_compute(key, len(ids), Admission.PRECOMPUTE):
                num_written += store.offer(key, collection.kv(ids), Admission.PRECOMPUTE)
    return {"ingest_s": round(time.perf_counter() - t0, 1), "chunks_precomputed": num_written}


def stream(store: KVStore, collection: Collection, order: np.ndarray, ttft_ms: list[float]) -> dict:
    """Questions over `order` (document ids): per question, its chunks' handles, then the misses
    computed and offered to the budget (the repairer's job, between questions)."""
    misses_per_question, chunk_hits = [], []
    for doc in order:
        chunks = collection.chunks(int(doc))
        keys = [store.key_for(ids) for ids in chunks]
        handles = [store.handle(key) for key in keys]
        for h in handles:
            if h is not None and h.entry is not None:
                h.entry.release()
        misses = [(key, ids) for key, ids, h in zip(keys, chunks, handles) if h is None]
        misses_per_question.append(len(misses))
        chunk_hits += [h is not None for h in handles]
        for key, ids in misses:
            if store.should_compute(key, len(ids), Admission.USE):
                store.offer(key, collection.kv(ids), Admission.USE)
    ttfts = [ttft_ms[m] for m in misses_per_question]
    half = len(order) // 2
    return {
        "hit_rate": round(mean(chunk_hits), 4),
        "hit_rate_second_half": round(mean(chunk_hits[half * collection.num_chunks:]), 4),
        "questions_all_hit": round(mean(m == 0 for m in misses_per_question), 4),
        "mean_ttft_ms": round(mean(ttfts), 1),
        "p95_ttft_ms": round(float(np.percentile(ttfts, 95)), 1),
        "mean_ttft_ms_second_half": round(mean(ttfts[half:]), 1),
    }


def measure_ttft(args: argparse.Namespace, num_chunks: int) -> tuple[list[float], dict]:
    """TTFT (ms, median of repeats) of a question over one document's chunks with 0..num_chunks of them
    missing, through the server's prefill executor in `--mode`, hits streamed from the disk tier."""
    settings, engine = load_engine(model_name=args.ttft_model)
    rng = np.random.default_rng(args.seed)
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 256
    chunks = [tuple(int(t) for t in rng.integers(100, vocab - 100, args.chunk_tokens)) for _ in range(num_chunks)]
    context = engine.sink_ids(settings.blend.sink)
    out: list[float] = []
    plans: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        store = _store(Path(tmp), engine.fingerprint, engine.kv_shape, 1 << 40)
        keys = [store.key_for(ids, context) for ids in chunks]
        for key, ids in zip(keys, chunks):
            store.put(key, engine.precompute(list(ids), context))
        executor = PrefillExecutor(engine, store, settings.blend, settings.store.planner_profile_tokens,
                                   settings.scheduler.prefill_chunk_tokens)
        for num_missing in range(num_chunks + 1):
            # a missing chunk: no stored KV, as the server's retrieval hands over a miss
            prompt = tuple(PromptChunk(ids, key if i >= num_missing else None)
                           for i, (ids, key) in enumerate(zip(chunks, keys)))
            request = PrefillRequest("What does the document say about it?", prompt, RequestMode(args.mode),
                                     SamplingParams(max_tokens=1))
            times = []
            for _ in range(args.ttft_repeats + 1):  # the first is a warm-up (and the planner's start-up)
                t0 = time.perf_counter()
                *_, outcome = executor.prefill_steps(request)
                int(outcome.result.logits.argmax())
                times.append((time.perf_counter() - t0) * 1000)
                store.promote(outcome.handles)  # as the engine loop does after the answer
            out.append(round(median(times[1:]), 1))
            plans.append(outcome.plan.plan if outcome.plan is not None else outcome.result.stats.mode.value)
        per_token = store.backend(store.tiers[0]).bytes_used() / (num_chunks * args.chunk_tokens)
        store.close()
    return out, {"model": settings.model.name, "bytes_per_token": round(per_token, 1),
                 "format": settings.store.quantization.value, "mode": args.mode, "plans_by_missing_chunks": plans}


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [float(x) for x in args.budgets.split(",") if x.strip()]
    if not budgets or any(not 0 < b <= 1 for b in budgets):
        raise ValueError(f"budgets must be shares in (0, 1], got {args.budgets!r}")
    engine = BlendEngine.from_config(ModelConfig(name=args.collection_model, device="cpu"))
    collection = Collection(engine, args)
    num_tokens = args.documents * collection.num_chunks * args.chunk_tokens
    ttft_ms, ttft_info = measure_ttft(args, collection.num_chunks)
    print(f"TTFT by chunks missing (0..{collection.num_chunks}), {ttft_info['model']}: {ttft_ms} ms", flush=True)
    rng = np.random.default_rng(args.seed)
    popularity = rng.permutation(args.documents)  # rank r -> document id: popular ≠ ingested first
    weights = 1.0 / np.arange(1, args.documents + 1) ** args.zipf
    order = popularity[rng.choice(args.documents, size=args.questions, p=weights / weights.sum())]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        # unbounded first: its bytes on disk are the collection's KV, the 100% the budgets are shares of;
        # the 100% row reopens that directory under exactly that bound (every entry fits: no re-ingest)
        store = _store(Path(tmp) / "full", engine.fingerprint, engine.kv_shape, 1 << 50)
        full_ingest = ingest(store, collection)
        full_bytes = store.backend(store.tiers[0]).bytes_used()
        store.close()
        print(f"collection ingested: {full_ingest}, {full_bytes} bytes", flush=True)
        for share in sorted(budgets):
            budget_bytes = int(share * full_bytes)
            if share == 1.0:
                store = _store(Path(tmp) / "full", engine.fingerprint, engine.kv_shape, budget_bytes)
                ingested = full_ingest
            else:
                store = _store(Path(tmp) / f"b{share}", engine.fingerprint, engine.kv_shape, budget_bytes)
                ingested = ingest(store, collection)
            streamed = stream(store, collection, order, ttft_ms)
            budget = store.budget_stats()
            row = {"budget": f"{share:.0%}", "budget_bytes": budget_bytes, **ingested, **streamed,
                   "bytes_on_disk": store.backend(store.tiers[0]).bytes_used(), "admitted": budget.admitted,
                   "rejected": budget.rejected, "evictions": budget.evictions}
            rows.append(row)
            store.close()
            print(f"{share:.0%}: {row}", flush=True)
        if 1.0 not in budgets:  # the reference: the collection's KV all kept
            store = _store(Path(tmp) / "full", engine.fingerprint, engine.kv_shape, full_bytes)
            rows.append({"budget": "100%", "budget_bytes": full_bytes, **full_ingest,
                         **stream(store, collection, order, ttft_ms), "bytes_on_disk": full_bytes})
            store.close()
    base = next(r["mean_ttft_ms"] for r in rows if r["budget"] == "100%")
    for row in rows:
        row["mean_ttft_vs_full_budget"] = round(row["mean_ttft_ms"] / base, 3)
    per_token = full_bytes / num_tokens
    summary = {
        "bench": "corpus", "documents": args.documents, "collection_tokens": num_tokens,
        "chunks": args.documents * collection.num_chunks, "chunk_tokens": args.chunk_tokens,
        "questions": args.questions, "zipf": args.zipf, "collection_model": args.collection_model,
        "collection_kv": args.collection_kv,
        "collection_kv_bytes": full_bytes, "collection_bytes_per_token": round(per_token, 1),
        "ttft_ms_by_missing_chunks": ttft_ms, "ttft": ttft_info,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "rows": rows,
    }
    real = args.smollm2_bytes_per_token or ttft_info["bytes_per_token"]
    summary["collection_kv_bytes_at_ttft_model"] = int(real * num_tokens)
    print(f"collection: {args.documents} documents, {num_tokens} tokens, KV {full_bytes / 1e6:.0f} MB "
          f"({per_token:.0f} B/token, {args.collection_model}); at {ttft_info['model']}'s "
          f"{real:.0f} B/token: {real * num_tokens / 1e9:.1f} GB")
    print(f"{'budget':>10s} {'hit rate':>9s} {'2nd half':>9s} {'mean TTFT':>10s} {'p95 TTFT':>9s} {'x 100%':>9s} "
          f"{'disk MB':>8s} {'evictions':>9s}")
    for r in rows:
        print(f"{r['budget']:>10s} {r['hit_rate']:9.3f} {r['hit_rate_second_half']:9.3f} {r['mean_ttft_ms']:10.0f} "
              f"{r['p95_ttft_ms']:9.0f} {r['mean_ttft_vs_full_budget']:9.3f} {r['bytes_on_disk'] / 1e6:8.1f} "
              f"{r.get('evictions', 0):9d}")
    emit_summary(summary, args.out)
    return 0
