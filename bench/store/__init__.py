"""What the KV store costs and saves, an engine and a store in this process: `kv` (blend TTFT per tier, the
loading planner's plans); docs/benchmarks/README.md. Retired in issue 64 (its Retired table): `kv-codec`
(`git show 66ac7e4:bench/store/codec.py`) and `corpus` (`git show 50937cd:bench/store/corpus.py`)."""
