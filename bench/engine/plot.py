"""`ragblend bench plot`: the KL-vs-speed frontier of an engine bench's JSON, as a PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="JSON written by `ragblend bench engine --out`")
    parser.add_argument("--out", required=True, help="PNG to write")


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")  # no display
    import matplotlib.pyplot as plt

    summary = json.loads(Path(args.input).read_text())
    rows = {k: v for k, v in summary["results"].items() if v["mode"] == "blend" and v["kl_vs_reuse"] is not None}
    if not rows:
        raise SystemExit("no blend rows with fidelity figures in the input (random weights?)")
    fig, ax = plt.subplots(figsize=(8, 5))
    for label, row in rows.items():
        marker = "s" if "adaptive" in label else ("^" if "sel=" in label else "o")
        ax.scatter(row["speedup_vs_full"], row["kl_vs_reuse"], marker=marker)
        ax.annotate(label.removeprefix("blend"), (row["speedup_vs_full"], row["kl_vs_reuse"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("TTFT speedup vs full prefill (x)")
    ax.set_ylabel("mean teacher-forced KL(full || blend) / reuse's")
    ax.set_title(f"{summary['model']}: {summary['questions']} questions x {summary['passages']} passages")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0
