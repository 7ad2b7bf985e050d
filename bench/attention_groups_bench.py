"""`ragblend bench attention-groups`: one layer's subset attention on the CPU, grouped as the engine groups
its queries (`attention.query_group_bounds`), through the engine's own metadata and call (`grouped_meta`,
`attend_heads`), against the grouping before stop 50 (8 groups of
num_queries / 8 rows) and one masked call over every key.

A blend prefill's recomputed tokens attend over the whole prompt, each up to its own position, with the
reused columns' bias (log of `reused_attention_scale`) in the mask: the CPU backend cuts the queries
into groups, each one SDPA call over the keys up to its last position. Per shape (queries over keys,
the share of queries in the prompt's tail, as blend's selections cluster near the question), the
three groupings run in turn, `--rounds` times; prints the medians and writes one JSON object (`--out`).
Random tensors of SmolLM2's head layout (9 query heads over 3 KV heads of 64), no model needed.
"""

from __future__ import annotations

import argparse
import itertools
import math
import platform
import time
from collections.abc import Callable
from statistics import median

import torch

from bench.harness.output import cpu_name, emit_summary
from blend_engine.attention import AttentionMeta, attend_heads, grouped_meta, query_group_bounds

# (queries, keys, share of the queries in the prompt's last queries-worth of positions)
SHAPES = ((521, 3125, 0.8), (521, 3125, 0.0), (900, 6000, 0.3), (250, 1500, 0.5), (130, 400, 0.2))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=12, help="rounds per shape (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="what the attention computes in (default: %(default)s, a long prefill's on AMX)")
    parser.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head size (default: %(default)s)")
    parser.add_argument("--out", help="also write the JSON summary here")


def old_bounds(num_queries: int) -> list[int]:
    """The grouping before stop 50: 8 groups (fewer under 64 queries each) of num_queries / groups rows."""
    num_groups = max(1, min(8, num_queries // 64))
    return [num_queries * i // num_groups for i in range(num_groups + 1)]


def query_positions(num_queries: int, num_keys: int, tail_share: float, generator: torch.Generator) -> torch.Tensor:
    """[num_queries] ascending positions: `tail_share` of them the prompt's last ones, the rest spread."""
    num_tail = round(num_queries * tail_share)
    spread = torch.randperm(num_keys - num_tail, generator=generator)[: num_queries - num_tail]
    return torch.cat([spread, torch.arange(num_keys - num_tail, num_keys)]).sort().values


def timed(fn: Callable[[], torch.Tensor]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def bench_shape(num_queries: int, num_keys: int, tail_share: float, heads: tuple[int, int, int], dtype: torch.dtype,
                rounds: int) -> dict:
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(num_queries * 7 + num_keys)
    pos = query_positions(num_queries, num_keys, tail_share, g)
    q = torch.randn(num_heads, num_queries, head_dim, generator=g).to(dtype)
    k, v = (torch.randn(num_kv_heads, num_keys, head_dim, generator=g).to(dtype) for _ in range(2))
    # a reused column's bias is log 0.5 (blend.reused_attention_scale), a fresh or recomputed one's 0
    bias = torch.where(torch.rand(num_keys, generator=g) < 0.8, math.log(0.5), 0.0)
    groupings = {"before": old_bounds(num_queries), "grouped": query_group_bounds(num_queries),
                 "one call": [0, num_queries]}
    host = pos.tolist()
    # the engine's own metadata and attention call (blend_engine/attention.py), cut at each grouping's bounds
    metas: dict[str, AttentionMeta] = {name: grouped_meta(pos, host, bounds, num_keys, dtype, bias)
                                       for name, bounds in groupings.items()}
    scale = head_dim ** -0.5
    reference = attend_heads(q, k, v, metas["before"], scale).float()  # [H, A, D]
    max_diff = {name: float((attend_heads(q, k, v, meta, scale).float() - reference).abs().max())
                for name, meta in metas.items()}
    times: dict[str, list[float]] = {name: [] for name in metas}
    for _ in range(rounds):
        for name, meta in metas.items():
            times[name].append(timed(lambda meta=meta: attend_heads(q, k, v, meta, scale)))
    return {"queries": num_queries, "keys": num_keys, "tail_share": tail_share,
            "groups": {name: [b - a for a, b in itertools.pairwise(bounds)] for name, bounds in groupings.items()},
            "median_ms": {name: median(values) for name, values in times.items()},
            "grouped_over_before": median(g / b for g, b in zip(times["grouped"], times["before"])),
            "max_abs_diff_vs_before": max_diff}


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    heads = tuple(int(x) for x in args.heads.split(","))
    if len(heads) != 3 or heads[0] % heads[1]:
        raise ValueError(f"--heads takes query heads, KV heads (dividing them) and head size, got {args.heads!r}")
    dtype = getattr(torch, args.dtype)
    rows = [bench_shape(a, n, tail, heads, dtype, args.rounds) for a, n, tail in SHAPES]
    print(f"one layer's subset attention, {args.dtype}, heads {args.heads}, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds}")
    print(f"{'queries over keys':>24}  {'before':>9}  {'grouped':>9}  {'one call':>9}  {'grouped/before':>14}")
    for row in rows:
        ms = row["median_ms"]
        print(f"{row['queries']:>6} over {row['keys']:>5}, tail {row['tail_share']:.1f}  {ms['before']:>7.2f}ms  "
              f"{ms['grouped']:>7.2f}ms  {ms['one call']:>7.2f}ms  {row['grouped_over_before']:>13.2f}x")
    emit_summary({"bench": "attention-groups", "machine": platform.machine(), "processor": cpu_name(),
                  "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
                  "heads": list(heads), "rounds": args.rounds, "shapes": rows}, args.out, indent=1)
    return 0
