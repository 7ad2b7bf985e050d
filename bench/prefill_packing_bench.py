"""Would packing several requests' blend prefills into one pass pay here? A blend prefill's compute is
its active tokens' rows through every layer's linear layers (qkv, o_proj, MLP) plus attention over
each request's own cache (which packing cannot share). This times the linear part, all layers, for M
rows against 2M rows (two requests' selected tokens packed): packing gains only where 2M rows cost
less than twice M.

    python -m bench.prefill_packing_bench --out docs/results/prefill_packing_cpu.json
    python -m bench.prefill_packing_bench --device cuda --model random:llama-7b \
        --out docs/results/prefill_packing_h100_llama7b.json

Interleaved rounds (the machine is shared and noisy); each ratio is the median of ratios taken within
one round.

Why it measures code that does not exist: it is the feasibility probe for packing prefills (issue 23;
docs/benchmarks/server.md), kept so that a GPU run (bench/device_check.sh) answers the same question.
"""

from __future__ import annotations

import argparse
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
from bench.harness.output import emit_summary  # noqa: E402
from blend_engine.engine import BlendEngine  # noqa: E402
from configs.settings import load_settings  # noqa: E402


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (fixed)")
    parser.add_argument("--rows", default="64,256,512,1024,3072",
                        help="M: active rows of one request (~15%% of a 3k prompt is ~500; before the first "
                        "check layer every token is active)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", default=None, help="model.name (default: the configured one), e.g. random:llama-7b")
    parser.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")


@torch.inference_mode()
def linear_pass(engine: BlendEngine, hidden: torch.Tensor) -> None:
    """hidden [M, hidden] through every layer's linear layers; attention's output stood in by zeros."""
    runner = engine.runner
    attn_out = torch.zeros(hidden.shape[0], runner.num_heads * runner.head_dim, dtype=hidden.dtype,
                           device=hidden.device)  # [M, H D]
    for layer in range(runner.num_layers):
        runner.qkv(layer, hidden)  # q [H, M, D], k, v [H_kv, M, D]
        hidden = runner.finish(layer, hidden, attn_out)


def timed(engine: BlendEngine, num_rows: int) -> float:
    # [M, hidden]
    hidden = torch.randn(num_rows, engine.model.config.hidden_size, dtype=engine.dtype, device=engine.device)
    is_cuda = engine.device.type == "cuda"
    if is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    linear_pass(engine, hidden)
    if is_cuda:  # the launches return before the kernels end
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    settings = load_settings(model=model_overrides(args))
    engine = BlendEngine.from_config(settings.model, settings.blend)
    rows = [int(r) for r in args.rows.split(",")]
    for m in rows:  # warm-up
        timed(engine, m), timed(engine, 2 * m)
    ratios: dict[int, list[float]] = {m: [] for m in rows}
    single: dict[int, list[float]] = {m: [] for m in rows}
    for _ in range(args.rounds):
        for m in rows:
            one, packed = timed(engine, m), timed(engine, 2 * m)
            single[m].append(one)
            ratios[m].append(packed / (2 * one))
    table = [{"rows": m, "one_ms": round(statistics.median(single[m]) * 1000, 1),
              "packed_vs_two_separate": round(statistics.median(ratios[m]), 3)} for m in rows]
    print(f"{'M rows':>7s} {'M ms':>8s} {'2M / (2 x M)':>13s}")
    for r in table:
        print(f"{r['rows']:7d} {r['one_ms']:8.1f} {r['packed_vs_two_separate']:13.3f}")
    summary = {"bench": "prefill-packing", "model": settings.model.name, "weights": settings.model.weights.value,
               "threads": args.threads, "rounds": args.rounds, "machine": f"{platform.machine()} {platform.processor()}",
               "device": str(engine.device),
               "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
               "rows": table}
    emit_summary(summary, args.out, indent=1)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
