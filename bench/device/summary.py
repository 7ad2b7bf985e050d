"""The device check's tables and targets: every step's JSON in the work folder read into summary.json and
summary.md, after each step, so a call cut short still brings back what ran (bench/device/check.sh).

    python -m bench.device.summary --work /tmp/device_check_work --out $OUT [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.output import fmt, table

Figures = dict[str, Any]


@dataclass(frozen=True)
class Target:
    """One of issue 41's targets for the GPU run (docs/benchmarks/gpu.md)."""

    name: str
    bound: str  # ">= 3.5" / "<= 1.2"
    value: Callable[[Figures], float | None]

    def check(self, figures: Figures) -> dict[str, Any]:
        try:
            value = self.value(figures)
        except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError):
            value = None
        op, limit = self.bound.split()
        met = None if value is None else (value >= float(limit) if op == ">=" else value <= float(limit))
        return {"name": self.name, "bound": self.bound, "value": value, "is_met": met}


def _graphed_decode_ratio(figures: Figures) -> float:
    rows = {row["batch_size"]: row["step_ms"] for row in figures["decode_8b"]["graphed"]}
    return rows[16] / rows[1]


def _throughput_ratio(figures: Figures) -> float | None:
    """blend's requests/s over full's (median of per-round ratios), where measured with 16 clients."""
    throughput = figures["server_throughput"]["throughput"]
    return throughput["ratios"]["blend/full"]["requests_per_s"]["median"] if throughput["clients"] == 16 else None


def _engine_ratio(figures: Figures) -> float:
    results = figures["engine_7b"]["results"]
    return results["full"]["median_ttft_ms"] / results["blend@0.15"]["median_ttft_ms"]


TARGETS = (
    Target("blend@0.15 TTFT vs full, Llama-2-7B shape (probe, graphed)", ">= 3.5",
           lambda f: f["prefill_7b"]["prefill"]["speedup_vs_full"]["blend_graphed"]),
    Target("blend@0.15 TTFT vs full, Llama-2-7B shape (engine bench, real prompts)", ">= 3.5", _engine_ratio),
    Target("blend@0.15 TTFT vs full, Llama-3-8B shape (GQA; probe, graphed)", ">= 4",
           lambda f: f["prefill_8b"]["prefill"]["speedup_vs_full"]["blend_graphed"]),
    Target("a reuse prefill's host time over its GPU time, 7B (graphed)", "<= 1.2",
           lambda f: f["prefill_7b"]["prefill"]["profile"]["reuse_graphed"]["cpu_over_gpu"]),
    Target("batch-16 decode step over batch-1, 3k-token caches, Llama-3-8B (GQA)", "<= 1.5", _graphed_decode_ratio),
    Target("16 clients: blend's requests/s over full's (server)", ">= 3", _throughput_ratio),
    Target("decode ms/token, Llama-2-7B shape (engine bench)", "<= 10",
           lambda f: f["decode_ms_7b"]),
)


def load(work: Path) -> Figures:
    """Every step's figures the work folder holds, by step."""
    figures: Figures = {}
    for name, path in (("prefill_7b", "prefill_7b.json"), ("prefill_8b", "prefill_8b.json"),
                       ("engine_7b", "engine_7b.json"), ("decode_8b", "decode_8b.json"),
                       ("server", "server/server.json"), ("server_modes", "server/server_modes.json"),
                       ("server_throughput", "server/server_throughput.json"), ("server_kv", "server/server_kv.json")):
        if (work / path).is_file():
            try:
                figures[name] = json.loads((work / path).read_text())
            except json.JSONDecodeError as exc:
                figures.setdefault("unreadable", {})[path] = str(exc)
    if "engine_7b" in figures and figures["engine_7b"].get("decode"):
        figures["decode_ms_7b"] = figures["engine_7b"]["decode"]["engine_ms_per_token"]
    steps = []
    if (work / "steps.tsv").is_file():
        for line in (work / "steps.tsv").read_text().splitlines():
            name, code, seconds = line.split("\t")
            steps.append({"step": name, "exit": int(code), "seconds": int(seconds)})
    figures["steps"] = steps
    if (work / "tests.log").is_file():
        lines = [ln for ln in (work / "tests.log").read_text().splitlines() if re.search(r"\d+ (passed|failed)", ln)]
        figures["tests"] = lines[-1].strip("= ") if lines else None
    return figures


def prefill_tables(p: Figures) -> list[str]:
    """The probe's prefill figures (bench/device/probe.py prints them too): per mode eager and graphed, then
    each profiled prefill's host time against its GPU time."""
    return [f"## Prefill, {p['model']} on {p['device']} ({p['num_prompt_tokens']} tokens, blend recomputes "
            f"{p['num_recomputed_blend']}; medians of {p['rounds']} rounds)", "",
            table(["mode", "eager ms", "graphed ms", "graphed speed-up", "vs full, eager", "vs full, graphed"], (
                [mode, fmt(p["ms"][f"{mode}_eager"]), fmt(p["ms"][f"{mode}_graphed"]),
                 fmt(p["graphed_speedup"][mode], 2, "x"), fmt(p["speedup_vs_full"][f"{mode}_eager"], 2, "x"),
                 fmt(p["speedup_vs_full"][f"{mode}_graphed"], 2, "x")] for mode in ("full", "reuse", "blend")),
                markdown=True), "",
            table(["profiled prefill", "host (CPU) ms", "GPU ms", "host / GPU"], (
                [name, fmt(row["cpu_ms"]), fmt(row["gpu_ms"]), fmt(row["cpu_over_gpu"], 2)]
                for name, row in p["profile"].items()), markdown=True)]


def markdown(summary: Figures) -> str:
    f, out = summary["figures"], []
    kind = "DRY RUN on CPU, tiny model: no figure below means anything" if summary["dry_run"] else "GPU run"
    out += [f"# Device check ({kind})", "", table(["step", "exit", "s"], ([s["step"], s["exit"], s["seconds"]]
                                                                       for s in f["steps"]), markdown=True)]
    if f.get("tests"):
        out += ["", f"tests: {f['tests']}"]
    met = {None: "not measured", True: "yes", False: "**no**"}
    out += ["", "## Targets", "", table(["target", "measured", "bound", "met"], (
        [t["name"], fmt(t["value"], 2), t["bound"], met[t["is_met"]]] for t in summary["targets"]), markdown=True)]
    for key in ("prefill_7b", "prefill_8b"):
        if key in f:
            out += ["", *prefill_tables(f[key]["prefill"])]
    if "engine_7b" in f:
        e = f["engine_7b"]
        out += ["", f"## Engine bench, {e['model']} ({e['questions']} questions, median prompt "
                f"{e['median_prompt_tokens']} tokens)", "", table(["variant", "TTFT ms", "vs full"], (
                    [label, fmt(row["median_ttft_ms"]), fmt(row["speedup_vs_full"], 2, "x")]
                    for label, row in e["results"].items()), markdown=True)]
        if e.get("decode"):
            d = e["decode"]
            out.append(f"\ndecode: engine {fmt(d['engine_ms_per_token'], 2)} ms/token (CUDA graph: {d['is_cuda_graph']}), "
                       f"HF eager {fmt(d['hf_eager_ms_per_token'], 2)}")
    if "decode_8b" in f:
        d = f["decode_8b"]
        eager = {row["batch_size"]: row["step_ms"] for row in d.get("batch") or []}
        graphed = {row["batch_size"]: row["step_ms"] for row in d.get("graphed") or []}
        out += ["", f"## Batched decode, {d['model']}, {d['context_tokens']}-token caches", "",
                table(["B", "eager step ms", "graphed step ms", "graphed vs B = 1"], (
                    [b, fmt(eager.get(b), 2), fmt(graphed.get(b), 2),
                     fmt(graphed[b] / graphed[1] if b in graphed and 1 in graphed else None, 2, "x")]
                    for b in sorted(set(eager) | set(graphed))), markdown=True)]
    if "server" in f:
        s = f["server"]
        out += ["", f"## Server, {s['servers']['server']['model']} ({s['questions']} questions x {s['passages']} "
                f"passages, {s['max_tokens']} tokens each)", "",
                table(["clients", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "tok/s", "req/s", "errors"], (
                    [r["clients"], fmt(r["ttft_p50_ms"]), fmt(r["ttft_p95_ms"]), fmt(r["itl_p50_ms"]),
                     fmt(r["tokens_per_s"]), fmt(r["requests_per_s"], 2), r["num_errors"]]
                    for r in s["results"]["server"]), markdown=True)]
    if "server_modes" in f:
        m = f["server_modes"]
        out += ["", f"## Server, per mode ({m['questions']} questions one at a time)", "",
                table(["mode", "e2e TTFT ms", "server TTFT ms", "prompt tokens", "reused tokens"], (
                    [mode, fmt(r["median_e2e_ttft_ms"]), fmt(r["median_server_ttft_ms"]),
                     fmt(r["median_prompt_tokens"], 0), fmt(r["median_reused_tokens"], 0)]
                    for mode, r in m["results"].items()), markdown=True)]
    throughputs = [f[key]["throughput"] for key in ("server_modes", "server_throughput") if f.get(key, {}).get("throughput")]
    if throughputs:
        out += ["", "## Server, requests/s per mode (clients at once, each its own question, the modes alternated)", "",
                table(["clients", "mode", "req/s", "TTFT p50 ms", "TTFT p95 ms", "errors"], (
                    [t["clients"], mode, fmt(row["requests_per_s"], 2), fmt(row["ttft_p50_ms"]), fmt(row["ttft_p95_ms"]),
                     row["num_errors"]] for t in throughputs for mode, row in t["modes"].items()), markdown=True)]
        for t in throughputs:
            for name, r in t["ratios"].items():
                rps = r["requests_per_s"]
                out.append(f"\n{t['clients']} clients: {name} requests/s {fmt(rps['median'], 2, 'x')} "
                           f"[{fmt(rps['min'], 2)}-{fmt(rps['max'], 2)}] (per round)")
    if "server_kv" in f:
        kv = f["server_kv"]
        tiers = sorted({tier for values in kv.values() for tier in values})
        out += ["", "## KV store after the request stream", "", table(["counter", *tiers], (
            [name, *(fmt(values.get(tier), 2) for tier in tiers)] for name, values in kv.items()), markdown=True)]
    return "\n".join(out) + "\n"


def write(work: Path, out: Path, is_dry_run: bool) -> Figures:
    figures = load(work)
    summary = {"dry_run": is_dry_run, "targets": [t.check(figures) for t in TARGETS], "figures": figures}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    write(args.work, args.out, args.dry_run)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
