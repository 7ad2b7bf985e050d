"""A prefill cut by layers (`BlendEngine.prefill_steps`): the same result as one prefill, whatever the
step budget (down to one layer a step), from memory and from a store streamed by a loader thread;
the budget rule; each part runs in inference mode on the governor's threads."""

import threading

import pytest
import torch

from blend_engine.engine import _on_cpu_threads
from blend_engine.prefill import last_part
from blend_engine.threads import ThreadGovernor
from blend_engine.types import BlendConfig, PrefillMode, SelectionKind
from configs.enums import KVQuantization, StorageDtype
from engine_models import build_engine, cpu_exact
from kv_store import KVStore, StoreConfig, Tier
from test_engine_blend import rag_prompt

NUM_LAYERS = 4  # the tiny models'


def parts_of(engine, segments, mode, blend=None, kv_source=None, budget=None):
    """(number of None parts, the result) of a prefill cut with `budget` token-layers a step."""
    parts = list(engine.prefill_steps(segments, mode, blend, kv_source, max_new_tokens=4,
                                      max_step_token_layers=budget))
    assert all(p is None for p in parts[:-1]) and parts[-1] is not None
    return len(parts) - 1, parts[-1]


def assert_identical(a, b):
    """Bit-identical: a cut prefill runs the same ops in the same order as one prefill."""
    n = len(b.token_ids)
    assert a.token_ids == b.token_ids and a.cache.length == b.cache.length
    assert torch.equal(a.logits, b.logits)
    assert torch.equal(a.cache.keys[:, :, :n], b.cache.keys[:, :, :n])
    assert torch.equal(a.cache.values[:, :, :n], b.cache.values[:, :, :n])
    assert (a.cache.column_bias is None) == (b.cache.column_bias is None)
    if a.cache.column_bias is not None:
        assert torch.equal(a.cache.column_bias.values, b.cache.column_bias.values)
    sa, sb = a.stats, b.stats
    assert sa.selected_positions == sb.selected_positions
    for name in ("mode", "num_prompt_tokens", "num_cached_tokens", "num_reused_tokens", "num_recomputed_tokens",
                 "recompute_ratio", "is_guarded", "unselected_mass", "last_token_shift"):
        assert getattr(sa, name) == getattr(sb, name), name


BLENDS = {
    "one-check": BlendConfig.cacheblend(recompute_ratio=0.2, check_layers=(1,)),
    "gradual": BlendConfig.cacheblend(recompute_ratio=0.2, check_layers=(1, 2)),
    # the probe lays out a layer ahead of the loop (layer 3 while the loop is at 1): across parts too
    "query-probe": BlendConfig.cacheblend(recompute_ratio=0.2, check_layers=(1,), selection=SelectionKind.QUERY_DEVIATION,
                               probe_layer=3, is_shift_measured=True, reused_attention_scale=0.8),
}


@cpu_exact
@pytest.mark.parametrize("blend_name", list(BLENDS))
@pytest.mark.parametrize("mode", [PrefillMode.BLEND, PrefillMode.REUSE, PrefillMode.PREFIX, PrefillMode.FULL])
def test_a_prefill_cut_by_layers_equals_one_prefill(mode, blend_name):
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, num_chunks=3, chunk_len=20)
    blend = BLENDS[blend_name]
    whole = engine.prefill(segments, mode, blend, max_new_tokens=4)
    n = len(whole.token_ids)
    # 1: a yield after every layer; n: about a layer a part (fewer tokens past blend's check); 3n: bigger parts
    for budget in (1, n, 3 * n, None):
        num_parts, cut = parts_of(engine, segments, mode, blend, budget=budget)
        assert_identical(cut, whole)
        if budget == 1:
            assert num_parts == NUM_LAYERS - 1  # never after the last layer: the result comes next
        if budget is None:
            assert num_parts == 0


def test_the_step_budget_counts_the_active_tokens_of_each_layer():
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, num_chunks=3, chunk_len=20)
    n = sum(len(s.token_ids) for s in segments)
    # full mode: every layer computes all n tokens (4n in all): a budget of 2n or a bit more, two parts
    assert parts_of(engine, segments, PrefillMode.FULL, budget=2 * n)[0] == 1
    assert parts_of(engine, segments, PrefillMode.FULL, budget=2 * n + 1)[0] == 1
    assert parts_of(engine, segments, PrefillMode.FULL, budget=n)[0] == NUM_LAYERS - 1
    assert parts_of(engine, segments, PrefillMode.FULL, budget=n * NUM_LAYERS)[0] == 0
    # blend at a 0 ratio: layers 0 and 1 compute all n, layers 2 and 3 only the fresh tokens
    blend = BlendConfig.cacheblend(recompute_ratio=0.0, check_layers=(1,))
    num_fresh = sum(len(s.token_ids) for s in segments if s.kv is None)
    assert parts_of(engine, segments, PrefillMode.BLEND, blend, budget=2 * n)[0] == 1
    assert parts_of(engine, segments, PrefillMode.BLEND, blend, budget=2 * n + num_fresh)[0] == 1
    assert parts_of(engine, segments, PrefillMode.BLEND, blend, budget=2 * n + 2 * num_fresh)[0] == 0
    with pytest.raises(ValueError, match="max_step_token_layers"):
        parts_of(engine, segments, PrefillMode.BLEND, blend, budget=0)


class RecordingSource:
    """A LayerKVSource over another, remembering the layers asked for: where each part ended."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def layer(self, layer_idx):
        self.asked.append(layer_idx)
        return self.inner.layer(layer_idx)

    def close(self):
        self.inner.close()


@pytest.fixture
def stored(tmp_path):
    """An engine, its prompt's chunks on the disk tier only, and the store."""
    engine = build_engine("llama-gqa")
    segments = rag_prompt(engine, num_chunks=3, chunk_len=20)
    # prefetch_depth 1: a pipelined reader of layers 1-3 waits for the engine after layer 2, so a test sees it
    # alive (with 2 it read all three and could end before the test looked: the closing test was flaky)
    store = KVStore(engine.fingerprint, StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32, fsync=False, disk_dir=tmp_path / "kv",
                                                    write_tiers=frozenset({Tier.DISK}), prefetch_depth=1),
                    shape=engine.kv_shape)
    handled = []
    for s in segments:
        if s.kv is None:
            handled.append(s)
            continue
        key = store.key_for(s.kv.token_ids, s.kv.context_ids)
        store.put(key, s.kv)
        handled.append(type(s)(s.token_ids, store.handle(key)))
    yield engine, segments, handled, store
    store.close()


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "kv-prefetch" and t.is_alive()]


@cpu_exact
@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("mode", [PrefillMode.BLEND, PrefillMode.REUSE])
def test_a_streamed_prefill_cut_by_layers_equals_one_prefill_from_memory(stored, mode, pipelined):
    engine, in_memory, handled, store = stored
    blend = BLENDS["one-check"]
    whole = engine.prefill(in_memory, mode, blend, max_new_tokens=4)
    handles = [s.kv for s in handled if s.kv is not None]
    for budget in (1, 40):
        source = store.layer_source(handles, engine.device, engine.dtype, pipelined=pipelined, start_layer=1)
        assert source.is_pipelined == pipelined
        try:
            num_parts, cut = parts_of(engine, handled, mode, blend, source, budget)
        finally:
            source.close()
        assert num_parts >= 1
        assert_identical(cut, whole)


def test_closing_a_streamed_prefill_midway_leaves_its_source_closable_and_no_thread(stored):
    engine, _, handled, store = stored
    handles = [s.kv for s in handled if s.kv is not None]
    before = set(prefetch_threads())  # another test's loader may still wait for the collector: not this one's
    source = store.layer_source(handles, engine.device, engine.dtype, pipelined=True, start_layer=1)
    own = set(prefetch_threads()) - before
    assert len(own) == 1
    parts = engine.prefill_steps(handled, PrefillMode.BLEND, BLENDS["one-check"], source, max_step_token_layers=1)
    assert next(parts) is None and next(parts) is None  # layers 0 and 1 done, stopped before layer 2
    parts.close()  # a cancelled request: the engine's side closes, the store's source stays the caller's
    with pytest.raises(StopIteration):
        next(parts)
    source.close()
    assert not any(t.is_alive() for t in own)


class _Governed:
    """The smallest engine-like owner of a governor, for `_on_cpu_threads` on a generator method."""

    def __init__(self, num_threads: int):
        self.threads = ThreadGovernor(num_fixed=num_threads)

    @_on_cpu_threads
    @torch.inference_mode()
    def parts(self, num_parts: int):
        for _ in range(num_parts):
            yield torch.get_num_threads(), torch.is_inference_mode_enabled()


def test_each_part_of_a_generator_method_runs_on_the_governors_threads_in_inference_mode():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parts = _Governed(num_threads=1).parts(3)
        seen = []
        for part in parts:
            seen.append(part)
            # between the parts, the caller's count and mode are back (another job runs there)
            assert torch.get_num_threads() == 2 and not torch.is_inference_mode_enabled()
        assert seen == [(1, True)] * 3
    finally:
        torch.set_num_threads(previous)


def test_prefill_is_prefill_steps_run_to_its_end(stored):
    engine, in_memory, handled, _ = stored
    a = engine.prefill(in_memory, PrefillMode.BLEND)
    b = last_part(engine.prefill_steps(in_memory, PrefillMode.BLEND, max_step_token_layers=1))
    assert_identical(b, a)
    with pytest.raises(ValueError, match="kv_source"):  # checked as before, when the prefill starts
        engine.prefill(handled, PrefillMode.BLEND)


def test_once_the_rest_is_known_the_parts_share_it_evenly(stored):
    """Reuse mode computes the fresh tokens only, at every layer (4f token-layers): a budget of 3f cuts
    it into two parts of two layers (not three layers and one)."""
    engine, _, handled, store = stored
    num_fresh = sum(len(s.token_ids) for s in handled if s.kv is None)
    handles = [s.kv for s in handled if s.kv is not None]
    source = RecordingSource(store.layer_source(handles, engine.device, engine.dtype, pipelined=False))
    try:
        parts = engine.prefill_steps(handled, PrefillMode.REUSE, None, source, max_step_token_layers=3 * num_fresh)
        assert next(parts) is None and source.asked == [0, 1]
        assert next(parts) is not None and source.asked == [0, 1, 2, 3]
    finally:
        source.close()
