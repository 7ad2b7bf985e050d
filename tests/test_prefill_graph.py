"""A prefill's layers past blend's last check from a token-count bucket's CUDA graphs
(blend_engine/prefill_graph.py): which bucket a count takes, and what the graphs replay against the
eager prefill, on CPU by running the same static functions eagerly, on CUDA (`pytest --device cuda`)
through the captured graphs themselves."""

import pytest
import torch

from blend_engine.prefill import last_part
from blend_engine.prefill_graph import MAX_BUCKETS, MAX_ROWS, MIN_ROWS, PrefillGraphs, bucket_rows
from blend_engine.types import BlendConfig, PrefillMode, SelectionKind
from configs.enums import KVQuantization, StorageDtype
from engine_models import MODEL_BUILDERS, build_engine, tol
from kv_store import KVStore, StoreConfig, Tier
from test_engine_blend import rag_prompt

FAMILIES = list(MODEL_BUILDERS)
MODES = [PrefillMode.BLEND, PrefillMode.REUSE, PrefillMode.PREFIX, PrefillMode.FULL]
BLENDS = {
    "cacheblend": BlendConfig.cacheblend(recompute_ratio=0.2),
    "gradual": BlendConfig.cacheblend(recompute_ratio=0.2, check_layers=(1, 2)),
    # the reused attention scaled: the layers past the check attend with a column bias in their mask
    "scaled": BlendConfig.cacheblend(recompute_ratio=0.2, reused_attention_scale=0.5),
    # the server's selection: query-ranked at layer 0 with a probe at layer 3
    "query-probe": BlendConfig.cacheblend(recompute_ratio=0.2, check_layers=(0,), selection=SelectionKind.QUERY,
                                          probe_layer=3, probe_span=2, reused_attention_scale=0.5),
}


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def graphed(engine, is_on: bool = True):
    engine.is_prefill_graphed = is_on
    return engine


def assert_close_prefill(actual, expected):
    """The padded bucket runs its matmuls over more rows than the eager layer (another blocking): equal
    up to fp32 rounding on CPU, bf16's on CUDA. The selection is made before the graphs: identical."""
    n = len(expected.token_ids)
    assert actual.token_ids == expected.token_ids and actual.cache.length == expected.cache.length
    scale = float(expected.logits.abs().max())
    if expected.logits.device.type == "cuda":
        torch.testing.assert_close(actual.logits, expected.logits, **tol(0))
    else:
        torch.testing.assert_close(actual.logits, expected.logits, atol=1e-5 * scale, rtol=0)
    for name in ("keys", "values"):
        a, b = getattr(actual.cache, name)[:, :, :n], getattr(expected.cache, name)[:, :, :n]
        torch.testing.assert_close(a, b, **tol(1e-5))
    assert (actual.cache.column_bias is None) == (expected.cache.column_bias is None)
    assert actual.stats.selected_positions == expected.stats.selected_positions
    assert actual.stats.num_recomputed_tokens == expected.stats.num_recomputed_tokens


# --- the buckets ------------------------------------------------------------------------------------

def test_bucket_rows_pads_at_most_a_quarter_and_grows_with_the_count():
    assert [bucket_rows(n) for n in (1, 15, 16, 17, 64, 65, 500, 512, 513, 3200)] == \
        [16, 16, 16, 32, 64, 80, 512, 512, 640, 3584]
    previous = 0
    for n in range(1, 10_000):
        rows = bucket_rows(n)
        assert rows >= n and rows % MIN_ROWS == 0 and rows >= previous
        assert rows - n < max(MIN_ROWS, n / 4)  # at most a quarter of the count padded (MIN_ROWS for small ones)
        previous = rows
    assert len({bucket_rows(n) for n in range(1025, 2049)}) == 4  # four buckets per doubling
    with pytest.raises(ValueError, match="at least one token"):
        bucket_rows(0)


def test_a_bucket_serves_one_prefill_at_a_time_and_the_least_recently_used_idle_ones_go():
    engine = build_engine("llama-gqa")
    graphs = PrefillGraphs(engine.runner)
    first = graphs.acquire(100)
    assert first.rows == bucket_rows(100) == 112
    assert graphs.acquire(99) is None  # the same bucket, in use: that prefill runs eagerly
    assert graphs.acquire(MAX_ROWS + 1) is None  # too many tokens for any bucket
    graphs.release(first)
    assert graphs.acquire(99) is first  # kept, and free again
    # counts of a bucket each, other than the one in use
    counts = sorted({bucket_rows(16 * (i + 1)) for i in range(30)} - {first.rows})[: MAX_BUCKETS + 2]
    for count in counts:
        graphs.release(graphs.acquire(count))
    assert len(graphs.buckets) == MAX_BUCKETS
    assert first.rows in graphs.buckets  # still in use: never dropped
    assert graphs.buckets[-1] == counts[-1] and counts[0] not in graphs.buckets  # the least recently used went
    graphs.release(first)
    graphs.close()
    assert graphs.buckets == []


def test_a_bucket_refuses_more_tokens_than_its_rows():
    engine = build_engine("llama-gqa")
    bucket = PrefillGraphs(engine.runner).acquire(20)
    hidden = torch.zeros(bucket.rows + 1, engine.model.config.hidden_size, device=engine.device, dtype=engine.dtype)
    rope = torch.zeros(bucket.rows + 1, engine.head_dim, device=engine.device, dtype=engine.dtype)
    with pytest.raises(ValueError, match="do not fit a bucket of 32 rows"):
        bucket.load(hidden, rope, rope)


# --- the graphed prefill against the eager one ----------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("blend_name", list(BLENDS))
@pytest.mark.parametrize("mode", MODES)
def test_the_graphed_prefill_equals_the_eager_one(family, blend_name, mode):
    engine = build_engine(family)
    segments = rag_prompt(engine, num_chunks=3, chunk_len=30)
    blend = BLENDS[blend_name]
    eager = graphed(engine, False).prefill(segments, mode, blend, max_new_tokens=4)
    assert engine.prefill_graphs.buckets == []  # off: no bucket was made
    result = graphed(engine).prefill(segments, mode, blend, max_new_tokens=4)
    assert_close_prefill(result, eager)
    # the tokens computed past the last check (the fresh and the recomputed ones) took their bucket
    num_past_check = result.stats.num_recomputed_tokens
    assert engine.prefill_graphs.buckets == [bucket_rows(num_past_check)]
    assert engine.prefill_graphs.acquire(num_past_check) is not None  # given back at the end


@pytest.mark.parametrize("mode", [PrefillMode.BLEND, PrefillMode.FULL])
def test_a_decode_after_a_graphed_prefill_equals_one_after_an_eager_prefill(mode):
    engine = build_engine("qwen2-bias")
    segments = rag_prompt(engine, num_chunks=2, chunk_len=25)
    blend = BLENDS["scaled"]
    tokens = {}
    for is_on in (False, True):
        result = graphed(engine, is_on).prefill(segments, mode, blend, max_new_tokens=8)
        tokens[is_on] = [engine.decoder(result, is_graphed=False).step(t) for t in (5, 6, 7)]
    for a, b in zip(tokens[True], tokens[False]):
        torch.testing.assert_close(a, b, **(tol(0) if b.device.type == "cuda" else
                                             dict(atol=1e-5 * float(b.abs().max()), rtol=0)))


@pytest.mark.parametrize("budget", [1, 40])
def test_a_graphed_prefill_cut_by_layers_equals_it_whole_and_frees_its_bucket_at_each_pause(budget):
    """Two prefills of the same bucket, their parts interleaved (as the server's loop may run them):
    each gives the bucket back at its pauses, so the other takes it; each equals its own prefill in one
    go, bit for bit (the same ops on the same rows)."""
    engine = graphed(build_engine("llama-gqa"))
    blend = BLENDS["scaled"]
    prompts = [rag_prompt(engine, num_chunks=3, chunk_len=30, seed=seed) for seed in (10, 11)]
    whole = [engine.prefill(p, PrefillMode.BLEND, blend, max_new_tokens=4) for p in prompts]
    assert len({r.stats.num_recomputed_tokens for r in whole}) == 1  # one bucket for both
    runs = [engine.prefill_steps(p, PrefillMode.BLEND, blend, max_new_tokens=4, max_step_token_layers=budget)
            for p in prompts]
    rows, graphs = bucket_rows(whole[0].stats.num_recomputed_tokens), engine.prefill_graphs
    results, num_pauses = [None, None], 0
    while None in results:
        for i, run in enumerate(runs):
            if results[i] is None:
                part = next(run)
                results[i] = part
                if part is None:  # paused: the bucket is free
                    num_pauses += 1
                    bucket = graphs.acquire(rows)
                    assert bucket is not None
                    graphs.release(bucket)
    assert num_pauses >= 2
    for cut, one in zip(results, whole):
        n = len(one.token_ids)
        if one.logits.device.type == "cuda":  # other kernels may sum in another order: bf16's tolerance
            assert_close_prefill(cut, one)
            continue
        assert torch.equal(cut.logits, one.logits)
        assert torch.equal(cut.cache.keys[:, :, :n], one.cache.keys[:, :, :n])
        assert torch.equal(cut.cache.values[:, :, :n], one.cache.values[:, :, :n])
    assert len(engine.prefill_graphs.buckets) == 1


def test_an_abandoned_graphed_prefill_gives_its_bucket_back():
    engine = graphed(build_engine("llama-gqa"))
    segments = rag_prompt(engine, num_chunks=3, chunk_len=30)
    parts = engine.prefill_steps(segments, PrefillMode.REUSE, BLENDS["cacheblend"], max_step_token_layers=1)
    assert next(parts) is None and next(parts) is None  # inside the graphed layers (reuse: from layer 0)
    (rows,) = engine.prefill_graphs.buckets
    parts.close()  # a cancelled request
    bucket = engine.prefill_graphs.acquire(rows)
    assert bucket is not None and bucket.rows == rows


@pytest.fixture
def stored(tmp_path):
    """An engine, its prompt's chunks on the disk tier only, and the store."""
    engine = build_engine("llama-rope-scaling")
    segments = rag_prompt(engine, num_chunks=3, chunk_len=30)
    config = StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32, fsync=False,
                         disk_dir=tmp_path / "kv", write_tiers=frozenset({Tier.DISK}))
    store = KVStore(engine.fingerprint, config, shape=engine.kv_shape)
    handled = []
    for s in segments:
        if s.kv is not None:
            key = store.key_for(s.kv.token_ids, s.kv.context_ids)
            store.put(key, s.kv)
            s = type(s)(s.token_ids, store.handle(key))
        handled.append(s)
    yield engine, segments, handled, store
    store.close()


@pytest.mark.parametrize("mode", [PrefillMode.BLEND, PrefillMode.REUSE])
def test_a_graphed_prefill_over_a_streamed_store_source_equals_the_eager_one_from_memory(stored, mode):
    """The server's case: reused KV laid out layer by layer by the store's loader thread, between
    the graphs' replays."""
    engine, in_memory, handled, store = stored
    blend = BLENDS["cacheblend"]
    eager = graphed(engine, False).prefill(in_memory, mode, blend, max_new_tokens=4)
    handles = [s.kv for s in handled if s.kv is not None]
    source = store.layer_source(handles, engine.device, engine.dtype, pipelined=True,
                                start_layer=1 if mode == PrefillMode.BLEND else 0)
    try:
        result = last_part(graphed(engine).prefill_steps(handled, mode, blend, source, max_new_tokens=4,
                                                         max_step_token_layers=50))
    finally:
        source.close()
    assert_close_prefill(result, eager)
