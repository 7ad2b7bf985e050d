"""The CUDA-graphed batched decode (`StaticBatch` over its KV pool, `DecodeBuckets`): what a graph
replays is checked here on CPU by running the same static step eagerly, and on CUDA (`pytest --device
cuda`) through the captured graphs themselves, against the eager batched step."""

import pytest
import torch

from blend_engine.batch_decode import DecodeBuckets, StaticBatch, batch_step
from blend_engine.types import SamplingParams
from engine_models import MODEL_BUILDERS, build_engine, cpu_exact, random_ids, tol
from test_batch_decode import MAX_TOKENS, decode_alone, one_thread, prefills  # noqa: F401 (fixture)

FAMILIES = list(MODEL_BUILDERS)
# which of the four requests (prefills) are in the batch at each step: members leave, come back and
# join late, the batch shrinks to one and grows to all four
SCHEDULE = [[0, 1, 2], [0, 1, 2], [0, 2], [0, 2, 3], [2, 3], [3], [0, 1, 2, 3], [0, 1, 2, 3], [1, 0], [0, 1, 2, 3]]


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    if expected.device.type == "cuda":
        torch.testing.assert_close(actual, expected, **tol(0))
    else:  # fp32: the pool's one attention call sums in another order than per-sequence attention
        torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bucket_over_its_pool_equals_the_eager_batched_step(family):
    """Rows bound, released and bound again as members come and go, a cache growing past the pool
    (made anew), the column bias of blended prompts: each step's logits are the eager batched step's,
    and once released every cache holds what the eager decode wrote into its own."""
    engine = build_engine(family)
    reference = [engine.decoder(r, is_graphed=False) for r in prefills(engine)]
    decoders = [engine.decoder(r, is_graphed=False) for r in prefills(engine)]
    bucket = StaticBatch(engine.runner, num_rows=4)
    bucket.CAPACITY_ROUNDING = 16  # the last request's cache (room for 2 new tokens) outgrows the pool
    capacities = []
    for token, members in zip(random_ids(len(SCHEDULE), 5), SCHEDULE):
        expected = batch_step(engine.runner, [reference[i] for i in members], [token] * len(members))
        positions = [decoders[i].reserve() for i in members]
        actual = bucket.step([decoders[i].cache for i in members], [token] * len(members), positions)
        assert_logits_close(actual, expected)
        capacities.append(bucket.capacity)
    assert len(set(capacities)) > 1  # the pool was made anew at least once
    assert decoders[0].cache.column_bias is not None and decoders[1].cache.column_bias is None
    bucket.release()
    for ours, theirs in zip(decoders, reference):
        length = theirs.cache.length
        assert ours.cache.length == length
        torch.testing.assert_close(ours.cache.keys[:, :, :length], theirs.cache.keys[:, :, :length], **tol(1e-5))
        torch.testing.assert_close(ours.cache.values[:, :, :length], theirs.cache.values[:, :, :length], **tol(1e-5))
    with pytest.raises(ValueError, match="1 to 4"):
        bucket.step([d.cache for d in decoders] * 2, [1] * 8, [0] * 8)


def test_buckets_follow_the_batch_size_and_release_before_a_sequence_decodes_alone():
    """DecodeBuckets: 3 sequences take the bucket of 4, still 4 at 2 and 4 again, a new one of 2 at
    1 of 4 (a quarter); a sequence decoded alone after a release goes on from every token it had."""
    engine = build_engine("llama-gqa")
    reference = [engine.decoder(r, is_graphed=False) for r in prefills(engine)]
    decoders = [engine.decoder(r, is_graphed=False) for r in prefills(engine)]
    buckets = DecodeBuckets(engine.runner)
    rows = []
    for token, members in zip(random_ids(5, 6), [[0, 1, 2], [0, 1], [0, 1, 2, 3], [0], [0, 2]]):
        expected = batch_step(engine.runner, [reference[i] for i in members], [token] * len(members))
        assert_logits_close(buckets.step([decoders[i] for i in members], [token] * len(members)), expected)
        rows.append(buckets._active.num_rows)
    assert rows == [4, 4, 4, 2, 2]
    buckets.release()  # decoder 0 decodes alone from here (the engine's B = 1 path)
    for token in random_ids(3, 7):
        assert_logits_close(decoders[0].step(token), reference[0].step(token))
    buckets.close()
    assert buckets._active is None


@cpu_exact
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_through_the_buckets_equal_tokens_alone(family):
    """The engine's decode_step with the graphed buckets (run eagerly here): four requests joining,
    finishing and growing as in test_batch_decode, each gets the tokens it gets alone."""
    engine = build_engine(family)
    params = [SamplingParams(max_tokens=n) for n in MAX_TOKENS]
    alone = [decode_alone(engine, result, p) for result, p in zip(prefills(engine), params)]
    engine.is_batch_graphed = True
    results = prefills(engine)
    sequences = [engine.start_sequence(r, p)[0] for r, p in zip(results[:3], params[:3])]
    batch_sizes = []
    while True:
        if len(batch_sizes) == 2:
            sequences.append(engine.start_sequence(results[3], params[3])[0])
        running = [s for s in sequences if not s.is_finished]
        if not running:
            break
        engine.decode_step(running)
        batch_sizes.append(len(running))
    assert [s.token_ids for s in sequences] == alone
    assert max(batch_sizes) == 4 and 1 in batch_sizes  # batched in a bucket, then alone after a release
    assert engine._buckets._active is None  # every sequence finished: the pool went back


def test_close_decode_batch_gives_the_pool_back_with_every_cache_whole():
    """What the engine loop calls when it goes idle (clients gone mid-answer: no step saw them finish)."""
    engine = build_engine("llama-gqa")
    engine.is_batch_graphed = True
    results = prefills(engine)[:2]
    sequences = [engine.start_sequence(r, SamplingParams(max_tokens=50, is_eos_ignored=True))[0] for r in results]
    for _ in range(3):
        engine.decode_step(sequences)
    assert engine._buckets._active is not None and engine._buckets._active.nbytes > 0
    engine.close_decode_batch()
    assert engine._buckets._active is None
    reference = [engine.decoder(r, is_graphed=False) for r in prefills(engine)[:2]]
    for sequence, decoder in zip(sequences, reference):  # its cache holds the 3 tokens fed in the pool
        for token in sequence.token_ids[:3]:
            decoder.step(token)
        assert_logits_close(sequence.decoder.step(sequence.token_ids[3]), decoder.step(sequence.token_ids[3]))
