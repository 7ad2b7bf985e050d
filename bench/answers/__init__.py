"""Are the answers right: the whole pipeline (`ask`, `pool`) or retrieval alone (`retrieval_quality`), on the
question sets under bench/data/ and MuSiQue (docs/benchmarks/answers.md)."""
