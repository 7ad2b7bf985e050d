"""Are the answers right: the whole pipeline, or its retrieval alone, on real documents (the question sets
under bench/data/, read by bench.harness.sets) and MuSiQue.

- `ask` (+ `scoring`, `settings`): `ragblend bench answers`, settings side by side through live servers;
- `pool`: `ragblend bench answers-pool`, several runs (other question sets) read as one;
- `retrieval_quality`: `ragblend bench retrieval-quality`, retrieval alone (no LLM) per chunking and ranking;
- `context_bound`: `ragblend bench context-bound`, the model's right answers by which chunks its prompt holds.
"""
