"""Are the answers right: the whole pipeline (`ask`, `pool`), retrieval alone (`retrieval_quality`) or the model
alone (`context_bound`), on the question sets under bench/data/ and MuSiQue (docs/benchmarks/answers.md)."""
