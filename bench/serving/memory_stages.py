"""What a server's start-up adds to its memory, stage by stage, in `Components.build`'s order and with its
constructors; run in a fresh interpreter by `ragblend bench memory`, which reads its last line (JSON)."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from bench.harness.memory import MB, malloc_mb, mappings, read_rss

STAGES = ("interpreter", "import torch", "server modules", "engine loaded", "embedder", "KV store",
          "planner measurement", "idle release")


def _reading(stage: str) -> dict:
    gc.collect()  # what is garbage is not the stage's
    return {"stage": stage, **asdict(read_rss()), **(malloc_mb() or {})}


def weights_by_kind(model) -> dict[str, float]:
    """MB of the model's parameters and buffers by name and dtype (e.g. 'gemm_weight bfloat16'), each
    storage once (fused layers' parts are views of the fused buffers)."""
    sizes: Counter[str] = Counter()
    seen: set[int] = set()
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        sizes[f"{name.rsplit('.', 1)[-1]} {str(tensor.dtype).removeprefix('torch.')}"] += storage.nbytes()
    return {kind: round(n / MB, 1) for kind, n in sizes.most_common() if n >= MB}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--config", type=Path, default=None)
    args = parser.parse_args(argv)
    readings = [_reading("interpreter")]
    import torch  # noqa: F401

    readings.append(_reading("import torch"))
    import app.main  # noqa: F401  what `ragblend serve` imports
    from app.components import kv_bytes_per_token
    from blend_engine.engine import BlendEngine
    from blend_engine.threads import single_threaded_default
    from configs.settings import load_settings
    from kv_store import KVStore
    from retrieval.retriever import Retriever
    from runtime.executor import PrefillExecutor
    from runtime.memory import release_idle_memory

    readings.append(_reading("server modules"))
    settings = load_settings(args.config, data_dir=args.data_dir)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = BlendEngine.from_config(settings.model, settings.blend, max_cpu_threads=single_threaded_default())
    readings.append(_reading("engine loaded"))
    retriever = Retriever.open(settings.data_dir, settings.retrieval, None)
    retriever.embedder.encode(["what the first question's embedding loads"])
    readings.append(_reading("embedder"))
    kv_store = KVStore(engine.fingerprint, settings.store.resolved(settings.data_dir), engine.device.type,
                       shape=engine.kv_shape)
    readings.append(_reading("KV store"))
    executor = PrefillExecutor(engine, kv_store, settings.blend, settings.store.planner_profile_tokens,
                               settings.scheduler.prefill_chunk_tokens)
    executor.measure_engine()
    readings.append(_reading("planner measurement"))
    release_idle_memory()  # as the server's loop does, on the thread that measured
    readings.append(_reading("idle release"))
    summary = {"stages": readings, "weights_mb": weights_by_kind(engine.model), "mappings_mb": mappings(),
               "kv_bytes_per_token": kv_bytes_per_token(engine)}
    kv_store.close()
    retriever.close()
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
