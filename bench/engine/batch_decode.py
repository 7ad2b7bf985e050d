"""`ragblend bench batch-decode`: one decode step for B sequences, each over its own cache, against B single
steps, interleaved in rounds; `--parts graphed` times the CUDA-graphed bucket step (docs/benchmarks/batch-decode.md).

    python -m bench.engine.batch_decode --device cuda --model random:llama-7b --parts batch,graphed --out F.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the `ragblend` script sets it (app/cli.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from bench.harness.args import add_model, add_out  # noqa: E402
from bench.harness.engine import model_overrides  # noqa: E402
from bench.harness.output import cpu_name, emit_summary, fmt, table  # noqa: E402
from bench.harness.stats import mean_ms  # noqa: E402
from blend_engine.batch_decode import StaticBatch, batch_step  # noqa: E402
from blend_engine.decode import Decoder  # noqa: E402
from blend_engine.engine import BlendEngine  # noqa: E402
from blend_engine.threads import governed  # noqa: E402
from blend_engine.types import PrefillMode, PrefillResult, Segment  # noqa: E402
from configs.settings import load_settings  # noqa: E402
from configs.enums import DecodeCache  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=3000, help="prompt tokens of each sequence's cache")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is reported)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per batch size and round")
    parser.add_argument("--parts", default="batch", help="batch: the B sweep; graphed: the B sweep of the "
                        "CUDA-graphed bucket step (on CPU run eagerly)")
    add_model(parser, threads=2)
    add_out(parser, help="write the figures here as JSON")


def _prompt(engine: BlendEngine, num_tokens: int) -> list[Segment]:
    """~num_tokens of the repo's docs (decode speed depends on the length only); random ids without a tokenizer."""
    if engine.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [Segment(tuple(torch.randint(100, engine.model.config.vocab_size, (num_tokens,),
                                            generator=generator).tolist()))]
    text = " ".join(p.read_text() for p in sorted(Path("docs/design").glob("*.md")))
    ids = engine.tokenize(text)
    while len(ids) < num_tokens:
        ids = ids + ids
    return [Segment(tuple(ids[:num_tokens]))]


def _own_results(engine: BlendEngine, result: PrefillResult, prompt: list[Segment], num: int,
                 max_new_tokens: int) -> list[PrefillResult]:
    """`num` prefills whose decoders write caches of their own: the same result where the decoder
    copies the cache (a decode cache other than the model's), else a prefill each (as requests have)."""
    if engine.decode_cache != DecodeCache.MODEL:
        return [result] * num
    return [result] + [engine.prefill(prompt, PrefillMode.FULL, max_new_tokens=max_new_tokens) for _ in range(num - 1)]


def _batch_sweep(engine: BlendEngine, results: list[PrefillResult], batch_sizes: list[int], args) -> list[dict]:
    """Per B: the batched step's ms (median over rounds), per token, and against B single steps
    (eager: on CUDA too, where B = 1 alone replays a graph in the server)."""
    decoders: dict[int, list[Decoder]] = {b: [engine.decoder(r, is_graphed=False) for r in results[:b]]
                                          for b in batch_sizes}
    tokens = {b: [int(results[0].logits.argmax())] * b for b in batch_sizes}
    timings: dict[int, list[float]] = {b: [] for b in batch_sizes}

    def step(b: int) -> None:
        with governed(engine.threads):
            logits = batch_step(engine.runner, decoders[b], tokens[b])  # [B, vocab]
        tokens[b] = logits.argmax(-1).tolist()

    for _ in range(args.rounds):
        for b in batch_sizes:
            timings[b].append(mean_ms(lambda: step(b), args.steps))
    return _rows(batch_sizes, timings)


def _graphed_sweep(engine: BlendEngine, results: list[PrefillResult], batch_sizes: list[int], args) -> list[dict]:
    """Per B: `StaticBatch`'s step for a bucket of B rows, captured once and replayed on CUDA (eager on CPU: a
    dry run); one B after the other (at 7B shape the buckets' KV pools would not fit together)."""
    decoders = [engine.decoder(r, is_graphed=False) for r in results[: max(batch_sizes)]]
    timings: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for b in batch_sizes:
        bucket, own = StaticBatch(engine.runner, num_rows=b), decoders[:b]
        tokens = [int(results[0].logits.argmax())] * b

        def step() -> None:
            nonlocal tokens
            positions = [d.reserve() for d in own]
            logits = bucket.step([d.cache for d in own], tokens, positions)  # [B, vocab]
            tokens = logits.argmax(-1).tolist()

        step()  # bind and capture outside the timing
        for _ in range(args.rounds):
            timings[b].append(mean_ms(step, args.steps))
        bucket.close()
    return _rows(batch_sizes, timings)


def _rows(batch_sizes: list[int], timings: dict[int, list[float]]) -> list[dict]:
    rows = []
    for b in batch_sizes:
        ms = statistics.median(timings[b])
        # the gain against B single-sequence steps: per round (the same load), then the median
        speedups = [b * one / ms_b for one, ms_b in zip(timings.get(1, []), timings[b])]
        rows.append({"batch_size": b, "step_ms": ms, "ms_per_token": ms / b,
                     "speedup_vs_single_steps": statistics.median(speedups) if speedups else None,
                     "step_ms_rounds": timings[b]})
    return rows


def run(args: argparse.Namespace) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    settings = load_settings(model={"cpu_threads": args.threads, **model_overrides(args)})
    engine = BlendEngine.from_config(settings.model, settings.blend, max_cpu_threads=args.threads)
    parts = set(args.parts.split(","))
    # no cache grows while timed: room for every step each sweep feeds the first sequence (+ warm-ups)
    steps_needed = args.rounds * args.steps * len(batch_sizes) * 2 + 8
    prompt = _prompt(engine, args.context)
    result = engine.prefill(prompt, PrefillMode.FULL, max_new_tokens=steps_needed)
    results = _own_results(engine, result, prompt, max(batch_sizes), steps_needed)
    sweep = _batch_sweep(engine, results, batch_sizes, args) if "batch" in parts else []
    graphed = _graphed_sweep(engine, results, batch_sizes, args) if "graphed" in parts else []

    print(f"model {engine.model_name}, weights {engine.weights.value}, decode cache {engine.decode_cache.value}, "
          f"{args.threads} threads, {args.context}-token caches; medians of {args.rounds} interleaved rounds")
    for name, rows in (("eager batched step", sweep), ("CUDA-graphed bucket step (StaticBatch)", graphed)):
        if not rows:
            continue
        one = next((row["step_ms"] for row in rows if row["batch_size"] == 1), None)
        print(f"\n{name}\n\n" + table(["B", "step ms", "ms / token", "vs B single steps", "vs the B = 1 step"], (
            [row["batch_size"], fmt(row["step_ms"], 2), fmt(row["ms_per_token"], 2),
             fmt(row["speedup_vs_single_steps"], 2, "x"), fmt(row["step_ms"] / one if one else None, 2, "x")] for row in rows),
            markdown=True))
    emit_summary({
        "machine": {"cpu": cpu_name(), "num_cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "load_avg_1m_at_end": os.getloadavg()[0]},
        "model": engine.model_name, "weights": engine.weights.value, "decode_cache": engine.decode_cache.value,
        "threads": args.threads, "context_tokens": args.context, "device": str(engine.device),
        "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
        "batch": sweep, "graphed": graphed,
    }, args.out, indent=1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
