"""The prefill on a lent GPU at any shape (random weights): full, reuse and blend, the prefill's graphs on and off,
interleaved in rounds, then one profiled prefill each, host time against GPU time (docs/benchmarks/gpu.md).

    python -m bench.device.probe --parts prefill [--model random:llama-7b] [--device cpu] --out probe.json
"""

from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from bench.device.summary import prefill_tables  # noqa: E402
from bench.harness.args import add_out  # noqa: E402
from bench.harness.output import emit_summary  # noqa: E402
from bench.harness.stats import timed_ms  # noqa: E402


def _event_ms(fn) -> float:
    """ms of one `fn` call, timed by CUDA events once the device is idle."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


PREFILL_MODES = ("full", "reuse", "blend")


def _timer(device: torch.device):
    """ms of one call: CUDA events on a GPU (the device idle first), the host clock on CPU."""
    return _event_ms if device.type == "cuda" else timed_ms


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
    print("\n" + "\n".join(prefill_tables(out)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # the one part left (bench/device/check.sh names it): the first GPU run's others were retired in issue 64
    parser.add_argument("--parts", default="prefill", choices=["prefill"], help="what to measure")
    parser.add_argument("--model", default="random:llama-7b", help="the prefill part's model.name")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"], help="the prefill part's device")
    parser.add_argument("--rounds", type=int, default=5, help="the prefill part's interleaved rounds")
    parser.add_argument("--chunk-tokens", type=int, default=600, help="the prefill part's tokens per chunk (5 chunks)")
    add_out(parser, help="write the figures here as JSON")
    args = parser.parse_args()
    emit_summary({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
                  "prefill": prefill(args.model, args.device, args.rounds, args.chunk_tokens)}, args.out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
