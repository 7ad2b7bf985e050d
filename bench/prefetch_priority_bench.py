"""Does the prefetch at retrieval slow the prefill running beside it, at the reader threads' normal or
idle priority (`store.loader_priority`, decision 0017)? On the 2-core CPU a request's chunks start
moving up from disk (int4 decode, a memory-tier put) as soon as it is retrieved, while the engine
computes an earlier request's prefill.

Per round, side by side: a blend prefill whose chunks are in the memory tier, alone; then the same
prefill right after `prefetch` started copying up `--prefetched` other chunks from the disk tier, once
with the prefetch thread at normal priority and once at idle (two stores, each with its own copy of
the chunks; the order alternates by round). Each figure is a median over rounds, each ratio the median
of ratios within one round.

    python -m bench.prefetch_priority_bench --out docs/results/prefetch_priority_cpu.json

Why it is twice the size of what it measures (kv_store/prefetch.py): a prefill beside a prefetch needs
two stores holding the same chunks on disk, a prefill whose chunks sit in memory, and rounds that
alternate which priority goes first; it is kept because decision 0017's figures are reproduced by it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the `ragblend` script sets it (app/cli.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.harness.output import emit_summary  # noqa: E402
from blend_engine.engine import BlendEngine  # noqa: E402
from blend_engine.kv import ChunkKV  # noqa: E402
from blend_engine.types import PrefillMode, Segment  # noqa: E402
from configs.enums import LoaderPriority
from configs.settings import load_settings  # noqa: E402
from kv_store.loader import handles_in  # noqa: E402
from kv_store import KVStore, StoreConfig, Tier  # noqa: E402

PRIORITIES = (LoaderPriority.NORMAL, LoaderPriority.IDLE)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model.name (default: the configured one)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of the engine (fixed)")
    parser.add_argument("--chunks", type=int, default=5, help="chunks of the measured prompt (memory tier)")
    parser.add_argument("--prefetched", type=int, default=20, help="other chunks prefetched from disk per run")
    parser.add_argument("--chunk-tokens", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)


class Setup:
    """One store (memory + disk tiers, the configured format) with the prompt's chunks in memory and two
    batches of other chunks on disk only; its prefetch thread at `priority`."""

    def __init__(self, engine: BlendEngine, root: Path, priority: LoaderPriority, prompt: list[tuple[int, ...]],
                 others: list[tuple[int, ...]], kvs: dict[tuple[int, ...], ChunkKV], context: tuple[int, ...]):
        settings = load_settings()
        self.engine, self.prompt, self.context = engine, prompt, context
        self.store = KVStore(engine.fingerprint, StoreConfig(
            disk_dir=root, fsync=False, dtype=settings.store.dtype, quantization=settings.store.quantization,
            max_memory_bytes=8 << 30, loader_priority=priority), engine.device.type, shape=engine.kv_shape)
        self.prompt_keys = [self.store.key_for(ids, context) for ids in prompt]
        for key, ids in zip(self.prompt_keys, prompt):
            self.store.put(key, kvs[ids])
        self.other_keys = [self.store.key_for(ids, context) for ids in others]
        for key, ids in zip(self.other_keys, others):
            self.store.backend(Tier.DISK).put(key, kvs[ids])

    def blend_ms(self) -> float:
        handles = [self.store.handle(k) for k in self.prompt_keys]
        segments = self.engine.build_segments("What do the passages say?",
                                              [Segment(ids, h) for ids, h in zip(self.prompt, handles)])
        source = self.store.layer_source(handles_in(segments), self.engine.device, self.engine.dtype,
                                         start_layer=self.engine.blend.check_layers[0])
        try:
            t0 = time.perf_counter()
            self.engine.prefill(segments, PrefillMode.BLEND, self.engine.blend, kv_source=source)
            return (time.perf_counter() - t0) * 1000
        finally:
            source.close()

    def blend_beside_prefetch_ms(self, batch: list[str]) -> float:
        memory = self.store.backend(Tier.MEMORY)
        for key in batch:  # on disk only again, so the prefetch has them to copy up
            memory.delete(key)
        if self.store.prefetch(batch) != len(batch):
            raise RuntimeError("the prefetch refused chunks: raise store.max_prefetch_bytes")
        elapsed = self.blend_ms()
        self.store._prefetcher.wait()  # done before the next run
        return elapsed


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    settings = load_settings(**({"model": {"name": args.model}} if args.model else {}))
    engine = BlendEngine.from_config(settings.model, settings.blend)
    rng = np.random.default_rng(args.seed)
    vocab = engine.tokenizer.vocab_size if engine.tokenizer is not None else 256

    def chunk() -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(100, vocab - 100, args.chunk_tokens))

    prompt = [chunk() for _ in range(args.chunks)]
    others = [chunk() for _ in range(2 * args.prefetched)]
    context = engine.sink_ids(settings.blend.sink)
    kvs = {ids: engine.precompute(list(ids), context) for ids in prompt + others}
    times: dict[str, list[float]] = {"alone": [], **{p.value: [] for p in PRIORITIES}}
    ratios: dict[str, list[float]] = {p.value: [] for p in PRIORITIES}
    with tempfile.TemporaryDirectory() as tmp:
        setups = {p: Setup(engine, Path(tmp) / p.value, p, prompt, others, kvs, context) for p in PRIORITIES}
        try:
            for setup in setups.values():  # warm-up
                setup.blend_ms(), setup.blend_beside_prefetch_ms(setup.other_keys[: args.prefetched])
            for r in range(args.rounds):
                alone = setups[PRIORITIES[0]].blend_ms()
                times["alone"].append(alone)
                batch = slice(0, args.prefetched) if r % 2 == 0 else slice(args.prefetched, None)
                for priority in PRIORITIES if r % 2 == 0 else PRIORITIES[::-1]:
                    setup = setups[priority]
                    elapsed = setup.blend_beside_prefetch_ms(setup.other_keys[batch])
                    times[priority.value].append(elapsed)
                    ratios[priority.value].append(elapsed / alone)
        finally:
            for setup in setups.values():
                setup.store.close()
    rows = [{"config": "blend alone", "blend_ms": round(statistics.median(times["alone"]), 1), "vs_alone": 1.0}]
    rows += [{"config": f"blend beside a prefetch at {p.value} priority",
              "blend_ms": round(statistics.median(times[p.value]), 1),
              "vs_alone": round(statistics.median(ratios[p.value]), 3)} for p in PRIORITIES]
    print(f"{'config':45s} {'blend ms':>9s} {'x alone':>8s}")
    for row in rows:
        print(f"{row['config']:45s} {row['blend_ms']:9.1f} {row['vs_alone']:8.3f}")
    summary = {"bench": "prefetch-priority", "model": settings.model.name, "weights": settings.model.weights.value,
               "format": settings.store.quantization.value, "threads": args.threads, "chunks": args.chunks,
               "prefetched": args.prefetched, "chunk_tokens": args.chunk_tokens, "rounds": args.rounds,
               "machine": f"{platform.machine()} {platform.processor()}", "rows": rows,
               "times_ms": {k: [round(t, 1) for t in v] for k, v in times.items()}}
    emit_summary(summary, args.out, indent=1)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
