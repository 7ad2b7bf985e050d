"""Batched decode on the real model: the time of one decode step for B = 1, 2, 4, 8 sequences (each
over its own ~3k-token cache) against B separate single-sequence steps, and the single-sequence check
that batching did not slow B = 1 down (today's `Decoder.step` against `BlendEngine.decode_step`).

    python -m bench.batch_decode_bench --threads 1 --out docs/results/batch_decode_cpu_int4_t1.json
    python -m bench.batch_decode_bench --device cuda --model random:llama-7b --batch-sizes 1,2,4,8,16 \
        --parts batch,graphed --out docs/results/batch_decode_h100_llama7b.json

On CUDA (the prefill's own caches: every sequence gets a prefill of its own) the `graphed` part times
`StaticBatch`, the bucketed step a CUDA graph replays, beside the eager batched step.

Everything is measured side by side, interleaved in rounds (the machine is shared and noisy): each
figure is the median over rounds (blocks) of their mean step time, each ratio the median of ratios
taken within one round (block pair). Tokens are greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the `ragblend` script sets it (app/cli.py)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from bench.harness.engine import model_overrides  # noqa: E402
from bench.harness.output import cpu_name  # noqa: E402
from blend_engine.batch_decode import StaticBatch, batch_step  # noqa: E402
from blend_engine.decode import Decoder  # noqa: E402
from blend_engine.engine import BlendEngine  # noqa: E402
from blend_engine.sequence import DecodeSequence, TokenSampler  # noqa: E402
from blend_engine.threads import governed  # noqa: E402
from blend_engine.types import PrefillMode, PrefillResult, SamplingParams, Segment  # noqa: E402
from configs.settings import load_settings  # noqa: E402
from configs.enums import DecodeCache, WeightFormat  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="CPU threads of every step (fixed)")
    parser.add_argument("--context", type=int, default=3000, help="prompt tokens of each sequence's cache")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (the median is reported)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per batch size and round")
    parser.add_argument("--single-tokens", type=int, default=64, help="tokens per round of the B = 1 check (each way)")
    parser.add_argument("--parts", default="single,batch,overhead",
                        help="single: the B = 1 check; batch: the B sweep; overhead: the API's own cost at B = 1; "
                             "graphed: the B sweep of the CUDA-graphed bucket step (on CPU run eagerly)")
    parser.add_argument("--model", default=None, help="model.name (default: the configured one), e.g. random:llama-7b")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--weights", default=None, choices=[w.value for w in WeightFormat],
                        help="model.weights (the graphed part needs the prefill's own caches: fp32 on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")


BLOCK = 8  # tokens per timed block of the B = 1 check


def _prompt(engine: BlendEngine, num_tokens: int) -> list[Segment]:
    """~num_tokens of real text (the repo's docs, repeated): decode speed depends on the length only.
    Random ids where the model has no tokenizer (a random-weight shape on a bare GPU host)."""
    if engine.tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        return [Segment(tuple(torch.randint(100, engine.model.config.vocab_size, (num_tokens,),
                                            generator=generator).tolist()))]
    text = " ".join(p.read_text() for p in sorted(Path("docs/design").glob("*.md")))
    ids = engine.tokenize(text)
    while len(ids) < num_tokens:
        ids = ids + ids
    return [Segment(tuple(ids[:num_tokens]))]


def _mean_ms(run, num_steps: int) -> float:
    start = time.perf_counter()
    for _ in range(num_steps):
        run()
    return (time.perf_counter() - start) * 1000 / num_steps


def _single_check(engine: BlendEngine, result: PrefillResult, args) -> dict:
    """B = 1, ms per token: today's `Decoder.step` plus sampling and detokenizing (what generate ran
    before, `decode_loop`) against `decode_step` on one sequence (what it runs now), alternating blocks
    of `BLOCK` tokens; the ratio is the median of each block pair's (robust to the load drifting)."""
    params = SamplingParams(max_tokens=10**6)

    def sampler() -> TokenSampler:  # no EOS ids: every block decodes its tokens (greedy, as the server's default)
        return TokenSampler(engine.tokenizer, frozenset(), params, engine.max_context, engine.device)

    old_ms, new_ms = [], []
    for _ in range(args.rounds):
        decoder, old_sampler = engine.decoder(result), sampler()  # a fresh copy of the prompt's cache
        _, token = old_sampler.push(result.logits)

        def old_step() -> None:
            nonlocal token
            _, token = old_sampler.push(decoder.step(token))

        new_sampler = sampler()
        _, first = new_sampler.push(result.logits)
        sequence = DecodeSequence(result, new_sampler, first, engine.decoder)
        sequence.prepare()  # the cache copy, outside the timing as for the old decoder
        for _ in range(args.single_tokens // BLOCK):
            old_ms.append(_mean_ms(old_step, BLOCK))
            new_ms.append(_mean_ms(lambda: engine.decode_step([sequence]), BLOCK))
    ratios = [new / old for old, new in zip(old_ms, new_ms)]
    return {"tokens_per_round": args.single_tokens, "rounds": args.rounds, "block_tokens": BLOCK,
            "decoder_step_ms": statistics.median(old_ms), "decode_step_ms": statistics.median(new_ms),
            "ratio_new_over_old": statistics.median(ratios),
            "decoder_step_ms_blocks": old_ms, "decode_step_ms_blocks": new_ms}


def _overhead_check(engine: BlendEngine, args) -> dict:
    """What the batched API adds to a step in Python, measured where the model's work is small: a random
    model of the real one's layer count (hidden 64, 4 heads, fp32, a 32-token prompt), B = 1, the old
    step + sampling against decode_step in alternating blocks (the real model's compute is the same ops,
    bit for bit: tests/test_batch_decode.py). Its difference is what B = 1 pays per token."""
    config = engine.model.config.__class__(
        hidden_size=64, intermediate_size=128, num_hidden_layers=engine.num_layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096)
    torch.manual_seed(0)
    tiny = BlendEngine.from_model(type(engine.model)(config).eval(), tokenizer=engine.tokenizer, name="tiny",
                                  cpu_threads=args.threads, max_cpu_threads=args.threads)
    result = tiny.prefill([Segment(tuple(range(17, 49)))], PrefillMode.FULL, max_new_tokens=4096 - 40)
    figures = _single_check(tiny, result, argparse.Namespace(**{**vars(args), "rounds": args.rounds * 4}))
    figures["added_us_per_token"] = 1000 * (figures["decode_step_ms"] - figures["decoder_step_ms"])
    figures["num_layers"] = engine.num_layers
    figures.update(_counts(tiny, result))
    return figures


def _counts(engine: BlendEngine, result: PrefillResult) -> dict:
    """Per token, the torch ops dispatched and the Python calls made, old step (+ sampling) and new:
    counts, so the load of a shared machine does not blur them."""
    import cProfile
    import pstats

    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.num_ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.num_ops += 1
            return func(*args, **(kwargs or {}))

    params = SamplingParams(max_tokens=10**6)
    old_sampler = TokenSampler(engine.tokenizer, frozenset(), params, engine.max_context, engine.device)
    _, token = old_sampler.push(result.logits)
    decoder = engine.decoder(result)

    def old_step() -> None:
        nonlocal token
        _, token = old_sampler.push(decoder.step(token))

    new_sampler = TokenSampler(engine.tokenizer, frozenset(), params, engine.max_context, engine.device)
    _, first = new_sampler.push(result.logits)
    sequence = DecodeSequence(result, new_sampler, first, engine.decoder)
    sequence.prepare()
    out = {}
    for name, step in (("decoder_step", old_step), ("decode_step", lambda: engine.decode_step([sequence]))):
        step()  # warm
        with OpCounter() as counter:
            step()
        profile = cProfile.Profile()
        profile.enable()
        step()
        profile.disable()
        out[f"{name}_torch_ops"] = counter.num_ops
        out[f"{name}_python_calls"] = pstats.Stats(profile).total_calls
    return out


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
            timings[b].append(_mean_ms(lambda: step(b), args.steps))
    return _rows(batch_sizes, timings)


def _graphed_sweep(engine: BlendEngine, results: list[PrefillResult], batch_sizes: list[int], args) -> list[dict]:
    """Per B: `StaticBatch`'s step for a bucket of B rows, on CUDA captured once (the caches have room
    for every timed step, so no capture is timed) and replayed, on CPU its static step run eagerly (a
    dry run of the code: the figures mean nothing there); the same figures as `_batch_sweep`. One B
    after the other (each bucket's KV pool freed before the next: at 7B shape they would not fit
    together), rounds within each."""
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
            timings[b].append(_mean_ms(step, args.steps))
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
    steps_needed = args.rounds * args.steps * len(batch_sizes) * 2 + args.single_tokens + 8
    result, results = None, []
    if parts & {"single", "batch", "graphed"}:
        prompt = _prompt(engine, args.context)
        result = engine.prefill(prompt, PrefillMode.FULL, max_new_tokens=steps_needed)
        if parts & {"batch", "graphed"}:
            results = _own_results(engine, result, prompt, max(batch_sizes), steps_needed)
    single = _single_check(engine, result, args) if "single" in parts else None
    sweep = _batch_sweep(engine, results, batch_sizes, args) if "batch" in parts else []
    graphed = _graphed_sweep(engine, results, batch_sizes, args) if "graphed" in parts else []
    overhead = _overhead_check(engine, args) if "overhead" in parts else None

    print(f"model {engine.model_name}, weights {engine.weights.value}, decode cache {engine.decode_cache.value}, "
          f"{args.threads} threads, {args.context}-token caches; medians of {args.rounds} interleaved rounds")
    if single is not None:
        print(f"\nB = 1: Decoder.step + sampling {single['decoder_step_ms']:.2f} ms/token, decode_step "
              f"{single['decode_step_ms']:.2f} ms/token (new / old, median of block pairs = "
              f"{single['ratio_new_over_old']:.3f})")
    if overhead is not None:
        print(f"\nAPI overhead at B = 1 ({overhead['num_layers']}-layer random model, hidden 64): Decoder.step + "
              f"sampling {overhead['decoder_step_ms']:.3f} ms/token, decode_step {overhead['decode_step_ms']:.3f} "
              f"(added {overhead['added_us_per_token']:.0f} us/token; new / old {overhead['ratio_new_over_old']:.3f}); "
              f"per token: torch ops {overhead['decoder_step_torch_ops']} -> {overhead['decode_step_torch_ops']}, "
              f"Python calls {overhead['decoder_step_python_calls']} -> {overhead['decode_step_python_calls']}")
    for name, rows in (("eager batched step", sweep), ("CUDA-graphed bucket step (StaticBatch)", graphed)):
        if not rows:
            continue
        print(f"\n{name}\n\n| B | step ms | ms / token | vs B single steps | vs the B = 1 step |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        one = next((row["step_ms"] for row in rows if row["batch_size"] == 1), None)
        for row in rows:
            speedup, ms = row["speedup_vs_single_steps"], row["step_ms"]
            print(f"| {row['batch_size']} | {ms:.2f} | {row['ms_per_token']:.2f} | "
                  f"{'' if speedup is None else f'{speedup:.2f}x'} | {'' if one is None else f'{ms / one:.2f}x'} |")
    if args.out is not None:
        figures = {
            "machine": {"cpu": cpu_name(), "num_cpus": os.cpu_count(), "platform": platform.platform(),
                        "torch": torch.__version__, "load_avg_1m_at_end": os.getloadavg()[0]},
            "model": engine.model_name, "weights": engine.weights.value, "decode_cache": engine.decode_cache.value,
            "threads": args.threads, "context_tokens": args.context,
            "device": str(engine.device), "gpu": _gpu_name(engine.device),
            "single_sequence": single, "batch": sweep, "graphed": graphed, "api_overhead": overhead,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0


def _gpu_name(device: torch.device) -> str | None:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
