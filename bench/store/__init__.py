"""What the KV store costs and saves, an engine and a store in this process: `kv` (blend TTFT per tier, the
loading planner's plans) and `corpus` (the collection's KV budget at corpus scale); docs/benchmarks/README.md.
The KV entry formats' bench (`kv-codec`) was retired in issue 64 (`git show 66ac7e4:bench/store/codec.py`)."""
