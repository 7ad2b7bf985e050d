"""ragblend's benchmarks, grouped by the question they answer (docs/benchmarks/README.md is the map).
Every group uses bench/harness/; no group imports another's benches."""

# group (bench/<group>/) -> the question it answers; `ragblend bench --help` lists the commands under them
GROUPS = {
    "engine": "how fast is blend, and how close to a full prefill (an engine in this process)",
    "store": "what the KV store costs and saves (tiers, the loading planner)",
    "serving": "does the server add overhead, and how does it serve many users (through its HTTP API)",
    "answers": "are the answers right (the whole pipeline, or retrieval alone, on real documents)",
    "device": "what a lent GPU measures (python -m bench.device.*, bash bench/device/check.sh)",
}
