"""The server end to end on a lent GPU (bench/device/check.sh's `server` step): `ragblend serve` on a random model
of a real shape with the packed tokenizer and embedder, then `bench server`, `bench server-modes` twice and
the KV tiers' counters (docs/benchmarks/gpu.md). Llama-3-8B's shape by default: with GQA, 16 answers' caches fit.

    python -m bench.device.server --out-dir /tmp/work [--model random:llama-3-8b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from app.cli import main as cli
from bench.device.pack import REPO_ROOT
from bench.device.pack import main as device_pack
from bench.harness.client import metrics
from bench.harness.servers import LocalServer, started


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", type=Path, required=True, help="JSON, logs and the embedder go here")
    parser.add_argument("--model", default="random:llama-3-8b")
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--pack", type=Path, default=REPO_ROOT / ".device", help="bench/device/pack.py's output")
    parser.add_argument("--data", type=Path, default=None, help="default: the pack's data/musique_dev.json")
    parser.add_argument("--concurrency", default="1,8,16", help="`bench server`'s client counts")
    parser.add_argument("--modes-clients", type=int, default=8,
                        help="`bench server-modes`' clients at once after its TTFT per mode (as many questions)")
    parser.add_argument("--throughput-clients", type=int, default=16,
                        help="then `bench server-modes`' clients at once, full's and blend's requests/s alone")
    parser.add_argument("--rounds", type=int, default=2, help="`bench server-modes`' throughput rounds")
    parser.add_argument("--questions", type=int, default=16, help="questions (5 passages each) `bench server` asks")
    parser.add_argument("--passages", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=16, help="scheduler.max_running")
    parser.add_argument("--max-running-kv-gib", type=int, default=16, help="scheduler.max_running_kv_bytes, GiB")
    parser.add_argument("--ready-timeout", type=float, default=300.0)


def server_env(args: argparse.Namespace, embedder: Path) -> dict[str, str]:
    """The settings the server runs with, as environment variables (docs/configuration.md)."""
    return {
        "RAGBLEND_MODEL__NAME": args.model,
        "RAGBLEND_MODEL__DEVICE": args.device,
        "RAGBLEND_MODEL__TOKENIZER": str((args.pack / "tokenizer").resolve()),
        "RAGBLEND_RETRIEVAL__EMBEDDER": str(embedder),
        "RAGBLEND_SCHEDULER__MAX_RUNNING": str(args.max_running),
        "RAGBLEND_SCHEDULER__MAX_QUEUE": str(4 * args.max_running),
        "RAGBLEND_SCHEDULER__MAX_RUNNING_KV_BYTES": str(args.max_running_kv_gib << 30),
    }


def kv_counters(url: str) -> dict[str, dict[str, float]]:
    """The KV store's per-tier counters (hits, misses, load seconds, bytes, evictions) from the server's /metrics."""
    with httpx.Client(base_url=url, timeout=30) as client:
        found = metrics(client, "ragblend_kv_")
    return {name: found[name] for name in ("hits", "misses", "load_seconds", "bytes", "evictions") if name in found}


def run(args: argparse.Namespace) -> int:
    out = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = (args.data or args.pack / "data" / "musique_dev.json").resolve()
    embedder = out / "embedder"
    if device_pack(["embedder", "--pack", str(args.pack), "--out", str(embedder)]) != 0:
        return 1
    server = LocalServer("device", server_env(args, embedder))
    common = ["--url", "", "--data", str(data), "--passages", str(args.passages), "--max-tokens", str(args.max_tokens)]
    status = 0
    with started(server, args.ready_timeout):
        common[1] = server.url
        try:
            status |= cli(["bench", "server", *common, "--concurrency", args.concurrency, "--ignore-eos",
                           "--questions", str(args.questions), "--settle-s", "1", "--out", str(out / "server.json")])
            modes = ["--throughput-modes", "full,blend", "--throughput-rounds", str(args.rounds)]
            status |= cli(["bench", "server-modes", *common, *modes, "--modes", "full,blend,reuse",
                           "--questions", str(args.modes_clients), "--concurrency", str(args.modes_clients),
                           "--out", str(out / "server_modes.json")])
            status |= cli(["bench", "server-modes", *common, *modes, "--modes", "",
                           "--questions", str(args.throughput_clients), "--concurrency", str(args.throughput_clients),
                           "--out", str(out / "server_throughput.json")])
            (out / "server_kv.json").write_text(json.dumps(kv_counters(server.url), indent=1) + "\n")
        finally:
            (out / "server_process.log").write_text(server.log_tail())
    return status


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
