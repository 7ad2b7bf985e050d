"""Two questions for a lent GPU, at Llama-2-7B shape (random weights, bf16), each answered in seconds:

1. attention: B = 16 decode queries over B caches of C slots, per layer, as the CUDA-graphed bucket
   step runs it today (one SDPA call per sequence) against one call over the B caches stacked
   ([B, H_kv, C, D], one [B, 1, 1, C] mask): replayed CUDA graphs of 32 layers' attention, timed
   with events (median of repeats), and the bytes' floor at the copy bandwidth measured here;
2. the reused attention scale: a REUSE prefill (5 chunks of 640 tokens from memory) with the
   scale (a column bias) and without, timed, then profiled: the ops that take the difference;
3. new shapes: the same prefills where every request has a question of another length (as in
   serving), with SDPA's cuDNN backend allowed (torch's default) and not;
4. prefill: full, reuse and blend prefills (5 chunks of 600 tokens from memory, the server's blend
   config) with the layers past the check from CUDA graphs (`model.prefill_graphs`) and eagerly,
   interleaved in rounds, at any shape (`--model random:llama-3-8b`: GQA); then one profiled prefill
   each: its host (CPU) time against its GPU time, the measure of a prefill bound by the host.
   `--device cpu --model random:tiny-llama` runs it on CPU (the device script's dry run).

    python -m bench.device_probe [--parts attention,scale,shapes,prefill] [--model random:llama-7b] --out probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def _graph_ms(fn, repeats: int = 20, replays: int = 10) -> float:
    """Median ms of one `fn` call, from a CUDA graph of it replayed `replays` times per timing."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def _event_ms(fn) -> float:
    """ms of one `fn` call, timed by CUDA events once the device is idle."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _llama7b(seed: int):
    """An engine at Llama-2-7B shape on CUDA, and `ids(n)`: n random token ids from a seeded generator."""
    from blend_engine.engine import BlendEngine
    from blend_engine.config import ModelConfig

    engine = BlendEngine.from_config(ModelConfig(name="random:llama-7b", device="cuda"))
    generator = torch.Generator().manual_seed(seed)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(100, 30000, (n,), generator=generator).tolist())

    return engine, ids


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + write counted)."""
    src = torch.randn(2**30, device="cuda")  # 4 GiB of fp32
    dst = torch.empty_like(src)
    ms = _graph_ms(lambda: dst.copy_(src), repeats=5, replays=3)
    return 2 * 2**32 / (ms / 1000)


def attention() -> dict:
    num_layers, heads, dim = 8, 32, 128  # 8 layers' caches (60 GB for 32 at C = 3584, B = 16); times x 4
    rows = []
    bandwidth = copy_bandwidth()
    for capacity in (1024, 3584):
        for batch in (1, 16):
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
            # per layer: the B caches stacked, and the same caches as B separate tensors
            stacked = [(torch.randn(batch, heads, capacity, dim, device="cuda", dtype=torch.bfloat16, generator=gen),
                        torch.randn(batch, heads, capacity, dim, device="cuda", dtype=torch.bfloat16, generator=gen))
                       for _ in range(num_layers)]
            lengths = torch.linspace(capacity // 2, capacity - 1, batch, device="cuda").long()  # [B]
            slots = torch.arange(capacity, device="cuda")
            mask = torch.where(slots[None, :] <= lengths[:, None], 0.0, float("-inf")).to(torch.bfloat16)  # [B, C]
            mask4 = mask[:, None, None, :]  # [B, 1, 1, C]

            def one_call():
                for k, v in stacked:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask4)

            def per_row():
                for k, v in stacked:
                    for b in range(batch):
                        F.scaled_dot_product_attention(q[b : b + 1], k[b : b + 1], v[b : b + 1],
                                                       attn_mask=mask4[b : b + 1])

            floor_ms = 1000 * num_layers * 2 * batch * capacity * heads * dim * 2 / bandwidth
            rows.append({"capacity": capacity, "batch": batch, "one_call_ms": 4 * _graph_ms(one_call),
                         "per_row_ms": 4 * _graph_ms(per_row), "bytes_floor_ms": 4 * floor_ms})
            stacked = []  # the closures' caches freed before the next size
            torch.cuda.empty_cache()
    return {"copy_bandwidth_gb_s": bandwidth / 1e9, "rows": rows}


def scale() -> dict:
    from blend_engine.types import BlendConfig, PrefillMode, Segment

    engine, ids = _llama7b(seed=0)
    chunks = [ids(640) for _ in range(5)]
    segments = [Segment(ids(20))] + [Segment(c, engine.precompute(c)) for c in chunks] + [Segment(ids(30))]
    out = {}
    for name, cfg in (("scaled", BlendConfig.cacheblend(reused_attention_scale=0.5)),
                      ("unscaled", BlendConfig.cacheblend(reused_attention_scale=1.0))):
        for mode in (PrefillMode.REUSE, PrefillMode.BLEND):
            run = lambda: engine.prefill(segments, mode, cfg)  # noqa: E731
            for _ in range(2):
                run()
            out[f"{mode.value}_{name}_ms"] = statistics.median(_event_ms(run) for _ in range(5))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.prefill(segments, PrefillMode.REUSE, cfg)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
        print(f"\n--- REUSE prefill, {name}: by CUDA time\n{table}")
        out[f"profile_{name}"] = table
    return out


def shapes() -> dict:
    """ms of REUSE and BLEND prefills, each at a question length not seen before (the first call at a
    shape), then again at a seen one; with the cuDNN attention backend allowed, then disabled."""
    from blend_engine.types import BlendConfig, PrefillMode, Segment

    engine, ids = _llama7b(seed=1)
    chunks = [Segment(c, engine.precompute(c)) for c in (ids(600 + 7 * i) for i in range(5))]
    out = {}
    question_len = 20
    for cudnn in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for mode in (PrefillMode.REUSE, PrefillMode.BLEND, PrefillMode.FULL):
            new_ms, seen_ms = [], []
            for _ in range(4):
                question_len += 1  # a prompt length this process has not run
                segments = [Segment(ids(20))] + chunks + [Segment(ids(question_len))]
                for times in (new_ms, seen_ms):
                    times.append(_event_ms(lambda: engine.prefill(segments, mode, BlendConfig.cacheblend())))
            key = f"{mode.value}_cudnn_{'on' if cudnn else 'off'}"
            out[key] = {"new_shape_ms": new_ms, "seen_shape_ms": seen_ms}
            print(f"{key}: new shape {statistics.median(new_ms):.1f} ms, seen {statistics.median(seen_ms):.1f} ms "
                  f"({', '.join(f'{a:.0f}/{b:.0f}' for a, b in zip(new_ms, seen_ms))})")
    torch.backends.cuda.enable_cudnn_sdp(True)
    return out


PREFILL_MODES = ("full", "reuse", "blend")


def _timer(device: torch.device):
    """ms of one call: CUDA events on a GPU (the device idle first), the host clock on CPU."""
    if device.type == "cuda":
        return _event_ms

    def host_ms(fn) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1000
    return host_ms


def prefill(model: str, device_name: str, rounds: int, chunk_tokens: int) -> dict:
    """TTFT of each mode with the prefill's graphs on and off (medians over interleaved rounds, each
    ratio the median of per-round ratios), then a profile of each mode with the graphs on and off:
    host time (the profiler's CPU self time) against the GPU's (its kernels' self time)."""
    from blend_engine.config import ModelConfig
    from blend_engine.engine import BlendEngine
    from blend_engine.types import PrefillMode, Segment

    engine = BlendEngine.from_config(ModelConfig(name=model, device=device_name))
    device = engine.device
    vocab = engine.model.config.vocab_size
    generator = torch.Generator().manual_seed(2)

    def ids(n: int) -> tuple[int, ...]:
        return tuple(torch.randint(100, min(vocab, 30000), (n,), generator=generator).tolist())

    segments = [Segment(ids(20))] + [Segment(c, engine.precompute(c)) for c in (ids(chunk_tokens) for _ in range(5))]
    segments.append(Segment(ids(30)))
    timer = _timer(device)

    def run(mode: str, is_graphed: bool) -> object:
        engine.is_prefill_graphed = is_graphed
        return engine.prefill(segments, PrefillMode(mode), max_new_tokens=64)

    times: dict[str, list[float]] = {f"{m}_{g}": [] for m in PREFILL_MODES for g in ("eager", "graphed")}
    for mode in PREFILL_MODES:  # warm-up: each bucket captured, every kernel's set-up done
        for is_graphed in (False, True):
            run(mode, is_graphed), run(mode, is_graphed)
    for _ in range(rounds):
        for is_graphed in (False, True):
            for mode in PREFILL_MODES:
                times[f"{mode}_{'graphed' if is_graphed else 'eager'}"].append(timer(lambda: run(mode, is_graphed)))
    result = run("blend", True)
    out = {"model": engine.model_name, "device": str(device), "num_prompt_tokens": len(result.token_ids),
           "num_recomputed_blend": result.stats.num_recomputed_tokens, "rounds": rounds,
           "ms": {k: statistics.median(v) for k, v in times.items()}, "ms_rounds": times}
    ratio = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
    out["speedup_vs_full"] = {f"{m}_{g}": ratio(f"full_{g}", f"{m}_{g}") for m in PREFILL_MODES
                              for g in ("eager", "graphed")}
    out["graphed_speedup"] = {m: ratio(f"{m}_eager", f"{m}_graphed") for m in PREFILL_MODES}
    out["profile"] = {}
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for mode in ("reuse", "blend"):
        for is_graphed in (False, True):
            with torch.profiler.profile(activities=activities) as prof:
                run(mode, is_graphed)
            events = prof.key_averages()
            cpu_ms = sum(e.self_cpu_time_total for e in events) / 1000
            gpu_ms = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1000
            out["profile"][f"{mode}_{'graphed' if is_graphed else 'eager'}"] = {
                "cpu_ms": cpu_ms, "gpu_ms": gpu_ms, "cpu_over_gpu": cpu_ms / gpu_ms if gpu_ms else None}
    engine.is_prefill_graphed = engine.device.type == "cuda"
    print(f"\nprefill, {engine.model_name} on {device}: {out['num_prompt_tokens']} prompt tokens, blend recomputes "
          f"{out['num_recomputed_blend']}; medians of {rounds} rounds\n")
    print("| mode | eager ms | graphed ms | graphed speed-up | vs full, graphed |\n| --- | ---: | ---: | ---: | ---: |")
    for mode in PREFILL_MODES:
        print(f"| {mode} | {out['ms'][f'{mode}_eager']:.1f} | {out['ms'][f'{mode}_graphed']:.1f} | "
              f"{out['graphed_speedup'][mode]:.2f}x | {out['speedup_vs_full'][f'{mode}_graphed']:.2f}x |")
    print("\n| profiled prefill | host (CPU) ms | GPU ms | host / GPU |\n| --- | ---: | ---: | ---: |")
    for name, row in out["profile"].items():
        over = "" if row["cpu_over_gpu"] is None else f"{row['cpu_over_gpu']:.2f}"
        print(f"| {name} | {row['cpu_ms']:.1f} | {row['gpu_ms']:.1f} | {over} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="attention,scale")
    parser.add_argument("--model", default="random:llama-7b", help="the prefill part's model.name")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="the prefill part's device")
    parser.add_argument("--rounds", type=int, default=5, help="the prefill part's interleaved rounds")
    parser.add_argument("--chunk-tokens", type=int, default=600, help="the prefill part's tokens per chunk (5 chunks)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    figures = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__}
    if "prefill" in parts:
        figures["prefill"] = prefill(args.model, args.device, args.rounds, args.chunk_tokens)
    if "attention" in parts:
        figures["attention"] = attention()
        print(f"\ncopy bandwidth {figures['attention']['copy_bandwidth_gb_s']:.0f} GB/s; attention of 32 layers:")
        print("| C | B | one call ms | per-row calls ms | bytes floor ms |\n| ---: | ---: | ---: | ---: | ---: |")
        for row in figures["attention"]["rows"]:
            print(f"| {row['capacity']} | {row['batch']} | {row['one_call_ms']:.2f} | {row['per_row_ms']:.2f} | "
                  f"{row['bytes_floor_ms']:.2f} |")
    if "scale" in parts:
        figures["scale"] = scale()
        print({k: round(v, 1) for k, v in figures["scale"].items() if k.endswith("_ms")})
    if "shapes" in parts:
        figures["shapes"] = shapes()
    if args.out is not None:
        args.out.write_text(json.dumps(figures, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
