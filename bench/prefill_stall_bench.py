"""The stall a running answer sees while another request's long blend prefill is admitted, with the
prefill cut into parts (`scheduler.prefill_chunk_tokens`: each of `--chunk-tokens`) and whole (a chunk
size past any prompt: the behaviour before parts).

    python -m bench.prefill_stall_bench --threads 1 --rounds 3 --out docs/results/prefill_stall_cpu_t1.json

The server's runtime without HTTP: the real model (settings' default), the engine loop and its
executor over an in-memory KV store. Per round and setting: one answer streams (a short prompt, EOS
ignored so it decodes throughout); after `--warm-tokens` of it, a blend request over `--chunks`
stored chunks (~3k tokens) is submitted; the round reports the running answer's largest gap between
two tokens from that submission until the blend's first token, its median gap before, the blend's
TTFT and how many parts its prefill ran in. Settings alternate within each round (the machine is
shared and noisy): each figure is the median over rounds, each ratio the median of per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the `ragblend` script sets it (app/cli.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from bench.harness.output import cpu_name  # noqa: E402
from blend_engine.engine import BlendEngine  # noqa: E402
from blend_engine.types import SamplingParams  # noqa: E402
from configs.settings import load_settings  # noqa: E402
from configs.enums import KVQuantization, RequestMode  # noqa: E402
from kv_store import KVStore, StoreConfig  # noqa: E402
from runtime.config import SchedulerConfig  # noqa: E402
from runtime.executor import PrefillExecutor  # noqa: E402
from runtime.loop import EngineLoop  # noqa: E402
from runtime.types import DoneEvent, PrefillRequest, PromptChunk, TokenEvent  # noqa: E402

OFF_CHUNK_TOKENS = 1_000_000  # past any prompt: every prefill runs whole (the behaviour before parts)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model.name (default: the settings', SmolLM2)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads of every engine step (fixed)")
    parser.add_argument("--chunk-tokens", default="512,128",
                        help="scheduler.prefill_chunk_tokens of the settings with parts (each against whole)")
    parser.add_argument("--chunks", type=int, default=12, help="stored chunks in the blend prompt")
    parser.add_argument("--chunk-size", type=int, default=250, help="tokens per stored chunk")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each running both settings")
    parser.add_argument("--warm-tokens", type=int, default=8, help="tokens the running answer decodes first")
    parser.add_argument("--after-tokens", type=int, default=4, help="its tokens after the blend's first one")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")


def _blend_request(engine: BlendEngine, store: KVStore, sink: tuple[int, ...], args) -> PrefillRequest:
    """`--chunks` chunks of real text (the repo's docs) stored with their KV, and a question."""
    text = " ".join(p.read_text() for p in sorted(Path("docs/design").glob("*.md")))
    ids = engine.tokenize(text)
    while len(ids) < args.chunks * args.chunk_size:
        ids = ids + ids
    chunks = []
    for i in range(args.chunks):
        token_ids = tuple(ids[i * args.chunk_size:(i + 1) * args.chunk_size])
        key = store.key_for(token_ids, sink)
        store.put(key, engine.precompute(token_ids, sink))
        chunks.append(PromptChunk(token_ids, key))
    return PrefillRequest("How does the server keep answers streaming while a long prompt is prefilled?",
                          tuple(chunks), RequestMode.BLEND, SamplingParams(max_tokens=1))


async def _round(loop: EngineLoop, blend: PrefillRequest, args) -> dict:
    running = loop.generate(PrefillRequest("Tell me a long story about owls.", (), RequestMode.BLEND,
                                           SamplingParams(max_tokens=2000)), time.perf_counter())
    times: list[float] = []
    t_submit = t_first = None
    parts_before = loop.stats.num_prefill_parts
    blend_task = None

    async def blend_ttft() -> float:
        t0 = time.perf_counter()
        async for event in loop.generate(blend, t0):
            if isinstance(event, TokenEvent) or isinstance(event, DoneEvent):
                return time.perf_counter() - t0
        raise RuntimeError("the blend request ended without an event")

    async for event in running:
        if not isinstance(event, TokenEvent):
            continue
        times.append(time.perf_counter())
        if len(times) == args.warm_tokens:
            t_submit = time.perf_counter()
            blend_task = asyncio.create_task(blend_ttft())
        if blend_task is not None and blend_task.done() and t_first is None:
            t_first = t_submit + blend_task.result()
            num_after = len(times)
        if t_first is not None and len(times) >= num_after + args.after_tokens:
            break
    running.cancel()
    before = [b - a for a, b in zip(times, times[1:]) if b <= t_submit]
    # every gap that overlaps [submission, the blend's first token]: the running answer's stall
    during = [b - a for a, b in zip(times, times[1:]) if b > t_submit and a < t_first]
    return {"max_gap_s": max(during), "median_gap_before_s": statistics.median(before),
            "blend_ttft_s": t_first - t_submit, "num_parts": loop.stats.num_prefill_parts - parts_before + 1}


def run(args: argparse.Namespace) -> int:
    model = {"cpu_threads": args.threads} | ({"name": args.model} if args.model else {})
    settings = load_settings(model=model)
    engine = BlendEngine.from_config(settings.model, settings.blend, max_cpu_threads=args.threads)
    engine.eos_ids = frozenset()  # the running answer decodes until the round cancels it, whatever it samples
    sink = engine.sink_ids(settings.blend.sink)
    with tempfile.TemporaryDirectory() as tmp:
        store = KVStore(engine.fingerprint, StoreConfig(quantization=KVQuantization.NONE, disk_dir=Path(tmp) / "kv"),
                        shape=engine.kv_shape)
        blend = _blend_request(engine, store, sink, args)
        variants = [(f"parts_{c}", int(c)) for c in args.chunk_tokens.split(",")] + [("whole", OFF_CHUNK_TOKENS)]
        results: dict[str, list[dict]] = {name: [] for name, _ in variants}
        for _ in range(args.rounds):
            for name, chunk_tokens in variants:
                executor = PrefillExecutor(engine, store, settings.blend, settings.store.planner_profile_tokens,
                                           chunk_tokens)
                # a decode step after every part: the stall the parts alone cause (no stall bound)
                loop = EngineLoop(engine, executor, SchedulerConfig(prefill_chunk_tokens=chunk_tokens,
                                                                    max_decode_stall_ms=0))
                try:
                    results[name].append(asyncio.run(_round(loop, blend, args)))
                finally:
                    loop.close()
                row = results[name][-1]
                print(f"{name:>10}: max gap {row['max_gap_s'] * 1000:8.0f} ms  (median before "
                      f"{row['median_gap_before_s'] * 1000:5.0f} ms)  blend TTFT {row['blend_ttft_s'] * 1000:8.0f} ms"
                      f"  parts {row['num_parts']}", flush=True)
        store.close()
    num_prompt_tokens = executor.num_prompt_tokens(blend)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    names = list(results)
    summary: dict = {key: {n: median(n, key) for n in names}
                     for key in ("max_gap_s", "median_gap_before_s", "blend_ttft_s", "num_parts")}
    whole = results["whole"]
    for name in names[:-1]:  # per round against the whole prefill of the same round, then the median
        summary[f"max_gap_ratio_{name}_vs_whole"] = statistics.median(
            a["max_gap_s"] / b["max_gap_s"] for a, b in zip(results[name], whole))
        summary[f"blend_ttft_ratio_{name}_vs_whole"] = statistics.median(
            a["blend_ttft_s"] / b["blend_ttft_s"] for a, b in zip(results[name], whole))
    print(f"\nmedians over {args.rounds} rounds, {num_prompt_tokens}-token blend prompt, {engine.model_name}, "
          f"{engine.num_layers} layers, {args.threads} thread(s)")
    print(f"{'':>20}" + "".join(f"{n:>12}" for n in names))
    for key in ("max_gap_s", "median_gap_before_s", "blend_ttft_s", "num_parts"):
        print(f"{key:>20}" + "".join(f"{summary[key][n]:12.3f}" for n in names))
    for name in names[:-1]:
        print(f"{name} vs whole: max gap {summary[f'max_gap_ratio_{name}_vs_whole']:.2f}x, blend TTFT "
              f"{summary[f'blend_ttft_ratio_{name}_vs_whole']:.2f}x")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "bench": "prefill_stall", "args": {k: str(v) for k, v in vars(args).items()},
            "machine": {"processor": cpu_name(), "num_cpus": os.cpu_count(), "torch": torch.__version__,
                        "platform": platform.platform()},
            "model": engine.model_name, "num_layers": engine.num_layers, "weights": str(engine.weights),
            "num_prompt_tokens": num_prompt_tokens, "summary": summary, "rounds": results,
        }, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0




def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
