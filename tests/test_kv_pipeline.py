"""Streaming stored KV into the engine's prefill: bit-identical to memory, pipelined or not,
recovery from entries that fail mid-request, prefetch order, and the overlap itself."""

import os
import threading
import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blend_engine.config import BlendConfig
from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode, Segment
from configs.enums import KVQuantization, LoaderPriority, StorageDtype
from kv_store import EntryLostError, KVStore, StoreConfig, StoreLayerSource, Tier
from kv_store.backend import ChunkInfo, LayerReader

NUM_CHUNKS, CHUNK_TOKENS = 3, 40
CTX = (1,)


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    return BlendEngine.from_model(LlamaForCausalLM(config), name="tiny-llama", blend=BlendConfig.cacheblend())


@pytest.fixture(scope="module")
def chunks(engine):
    g = torch.Generator().manual_seed(1)
    ids = [tuple(torch.randint(2, 256, (CHUNK_TOKENS,), generator=g).tolist()) for _ in range(NUM_CHUNKS)]
    return [engine.precompute(t, CTX) for t in ids]


def make_store(engine, tmp_path, dtype=StorageDtype.FLOAT32, **kw) -> KVStore:
    kw.setdefault("disk_dir", tmp_path / "kv")
    kw.setdefault("quantization", KVQuantization.NONE)
    kw.setdefault("disk_enabled", kw["disk_dir"] is not None)
    engine_device_type = kw.pop("engine_device_type", "cpu")
    return KVStore(engine.fingerprint, StoreConfig(dtype=dtype, fsync=False, **kw), engine_device_type,
                   shape=engine.kv_shape)


def put_all(store, chunks) -> list[str]:
    keys = [store.key_for(kv.token_ids, kv.context_ids) for kv in chunks]
    for key, kv in zip(keys, chunks):
        store.put(key, kv)
    return keys


def prompt(caches) -> list[Segment]:
    return [Segment((1, 5, 6))] + [Segment(c.token_ids, c) for c in caches] + [Segment((7, 8, 9, 10))]


def prefill_from(engine, store, handles, mode, pipelined, recompute=None):
    source = store.layer_source(handles, engine.device, engine.dtype, pipelined=pipelined, start_layer=1,
                                recompute=recompute)
    try:
        return engine.prefill(prompt(handles), mode=mode, kv_source=source), source
    finally:
        source.close()


@pytest.mark.parametrize("dtype", [StorageDtype.FLOAT32, StorageDtype.FLOAT16])
@pytest.mark.parametrize("mode", [PrefillMode.BLEND, PrefillMode.REUSE])
def test_disk_prefill_bit_identical_to_memory(engine, chunks, tmp_path, dtype, mode):
    store = make_store(engine, tmp_path, dtype, write_tiers=frozenset({Tier.DISK}))
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    assert all(h.tier == Tier.DISK and h.num_tokens == CHUNK_TOKENS and h.context_ids == CTX for h in handles)
    in_memory = [store.backend(Tier.DISK).get(k) for k in keys]  # what the memory tier would hold
    expected = engine.prefill(prompt(in_memory), mode=mode)
    for pipelined in (False, True):
        result, source = prefill_from(engine, store, handles, mode, pipelined)
        assert torch.equal(result.logits, expected.logits), f"pipelined={pipelined}"
        assert result.stats.selected_positions == expected.stats.selected_positions
        assert source.stats.num_bytes_loaded > 0 and source.stats.num_recovered == 0
    if dtype == StorageDtype.FLOAT32:  # fp32 storage: identical to the freshly computed caches too
        assert torch.equal(engine.prefill(prompt(chunks), mode=mode).logits, expected.logits)


def test_memory_handles_stream_the_same(engine, chunks, tmp_path):
    store = make_store(engine, tmp_path)
    handles = [store.handle(k) for k in put_all(store, chunks)]
    assert {h.tier for h in handles} == {Tier.MEMORY}
    result, _ = prefill_from(engine, store, handles, PrefillMode.BLEND, True)
    assert torch.equal(result.logits, engine.prefill(prompt(chunks), mode=PrefillMode.BLEND).logits)


def _flip_last_layer(path) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the last tensor's bytes: discovered only when that layer streams in
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("pipelined", [False, True])
def test_entry_damaged_mid_stream_is_recomputed(engine, chunks, tmp_path, pipelined):
    store = make_store(engine, tmp_path, max_memory_bytes=0)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]  # headers are fine: the damage is found mid-prefill
    _flip_last_layer(store.backend(Tier.DISK).path(keys[1]))
    expected = engine.prefill(prompt(chunks), mode=PrefillMode.BLEND)
    result, source = prefill_from(engine, store, handles, PrefillMode.BLEND, pipelined, recompute=engine.precompute)
    assert torch.equal(result.logits, expected.logits)
    assert source.stats.num_recovered == 1
    assert store.stats().tiers["disk"].corrupt == 1
    healed = store.get(keys[1])  # rewritten by the recovery
    assert healed is not None and torch.equal(healed.keys, chunks[1].keys)


def test_pipelined_recovery_runs_on_the_engine_thread_not_the_prefetch_thread(engine, chunks, tmp_path):
    """Recomputing is a forward: it must never run on the reader thread beside the engine's own."""
    store = make_store(engine, tmp_path, max_memory_bytes=0)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    _flip_last_layer(store.backend(Tier.DISK).path(keys[1]))
    threads = []

    def recompute(token_ids, context_ids):
        threads.append(threading.current_thread().name)
        return engine.precompute(token_ids, context_ids)

    result, source = prefill_from(engine, store, handles, PrefillMode.BLEND, True, recompute=recompute)
    assert threads == [threading.current_thread().name] and source.stats.num_recovered == 1
    assert torch.equal(result.logits, engine.prefill(prompt(chunks), mode=PrefillMode.BLEND).logits)
    assert store.stats().num_recovered == 1


def test_readers_already_open_are_closed_when_a_recovery_raises(engine, chunks, tmp_path):
    store = make_store(engine, tmp_path)
    keys = [store.key_for(kv.token_ids, kv.context_ids) for kv in chunks]
    for key, kv in zip(keys[:2], chunks[:2]):
        store.backend(Tier.DISK).put(key, kv)  # the first two on disk: their handles hold open files
    store.backend(Tier.MEMORY).put(keys[2], chunks[2])
    handles = [store.handle(k) for k in keys]
    assert [h.tier for h in handles] == [Tier.DISK, Tier.DISK, Tier.MEMORY]
    opened = [h.entry._reader for h in handles[:2]]
    store.delete(keys[2])  # the last chunk is gone and there is no recompute: layer_source raises
    with pytest.raises(EntryLostError):
        store.layer_source(handles, engine.device, engine.dtype, pipelined=True)
    assert all(r._fd == -1 for r in opened)  # both file descriptors closed


def test_entry_damaged_without_recompute_raises_cleanly(engine, chunks, tmp_path):
    store = make_store(engine, tmp_path, max_memory_bytes=0)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    _flip_last_layer(store.backend(Tier.DISK).path(keys[0]))
    with pytest.raises(EntryLostError, match="no recompute"):
        prefill_from(engine, store, handles, PrefillMode.BLEND, True)
    assert not store.contains(keys[0])  # deleted: the next lookup misses and the caller recomputes


def test_entry_vanished_after_handle_is_recomputed(engine, chunks, tmp_path):
    store = make_store(engine, tmp_path, disk_enabled=False)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    store.delete(keys[2])  # e.g. evicted by another request in between
    result, source = prefill_from(engine, store, handles, PrefillMode.BLEND, True, recompute=engine.precompute)
    assert torch.equal(result.logits, engine.prefill(prompt(chunks), mode=PrefillMode.BLEND).logits)
    assert store.stats().num_recovered == 1 and store.contains(keys[2])


def test_disk_entry_deleted_after_handle_streams_from_the_open_file(engine, chunks, tmp_path):
    """The handle holds the entry open: an eviction in between costs no recompute (the bytes are verified)."""
    store = make_store(engine, tmp_path, max_memory_bytes=0)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    store.delete(keys[2])
    result, source = prefill_from(engine, store, handles, PrefillMode.BLEND, True, recompute=engine.precompute)
    assert torch.equal(result.logits, engine.prefill(prompt(chunks), mode=PrefillMode.BLEND).logits)
    assert source.stats.num_recovered == 0


class SlowReader(LayerReader):
    """A reader whose every layer takes `delay_s` (like a slow disk), to observe the overlap."""

    def __init__(self, delay_s: float, num_layers: int = 8):
        self.info = ChunkInfo("0" * 64, (1, 2), (), num_layers, 64)
        self.delay_s, self.layers_read = delay_s, []

    def read_layer(self, layer_idx, pinned=False):
        time.sleep(self.delay_s)
        self.layers_read.append(layer_idx)
        return torch.full((1, 2, 4), float(layer_idx)), torch.zeros(1, 2, 4)


def _never_recover(idx, exc):
    raise exc


def _consume(source, layers, compute_s) -> float:
    start = time.perf_counter()
    for layer in layers:
        (k, _), = source.layer(layer)
        assert k[0, 0, 0].item() == layer
        time.sleep(compute_s)  # the engine's work on this layer
    source.close()
    return time.perf_counter() - start


def test_pipelining_overlaps_loads_with_compute():
    delay = 0.03
    sync = _consume(StoreLayerSource([SlowReader(delay)], "cpu", torch.float32, _never_recover, False), range(8), delay)
    piped = _consume(StoreLayerSource([SlowReader(delay)], "cpu", torch.float32, _never_recover, True), range(8), delay)
    assert sync >= 16 * delay
    assert piped < 0.7 * sync  # ideal: 9 * delay vs 16 * delay


def test_the_loader_thread_runs_torch_on_one_thread_inside_the_engines_job():
    """The reader thread starts during the engine's (governed, wider) job: pinned to one thread, it
    never holds an OpenMP pool beside the engine's (README: a restarted server decoded at half speed)."""

    class CountingReader(SlowReader):
        def read_layer(self, layer_idx, pinned=False):
            counts.append((threading.current_thread().name, torch.get_num_threads()))
            return super().read_layer(layer_idx, pinned)

    counts = []
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the engine's job
    try:
        source = StoreLayerSource([CountingReader(0.0)], "cpu", torch.float32, _never_recover, True, prefetch_depth=8)
        for layer in range(8):
            source.layer(layer)
        source.close()
    finally:
        torch.set_num_threads(previous)
    in_reader = [count for name, count in counts if name == "kv-prefetch"]
    assert in_reader and set(in_reader) == {1}


def test_prefetch_starts_at_start_layer_and_follows_skips():
    reader = SlowReader(0.0)
    source = StoreLayerSource([reader], "cpu", torch.float32, _never_recover, True, prefetch_depth=1, start_layer=2)
    assert source.layer(3)[0][0][0, 0, 0].item() == 3  # layer 2 skipped by the engine
    assert source.layer(5)[0][0][0, 0, 0].item() == 5
    with pytest.raises(ValueError, match="increasing"):
        source.layer(4)
    source.close()
    assert 0 not in reader.layers_read and 1 not in reader.layers_read
    assert max(reader.layers_read) <= 6 + 1  # never more than prefetch_depth (+ one in flight) ahead


def test_reader_error_reaches_the_engine_thread():
    class Broken(SlowReader):
        def read_layer(self, layer_idx, pinned=False):
            raise OSError("disk gone")

    source = StoreLayerSource([Broken(0.0)], "cpu", torch.float32, _never_recover, True)
    with pytest.raises(OSError, match="disk gone"):
        source.layer(0)
    source.close()


def test_reader_error_on_a_skipped_layer_still_reaches_the_engine():
    class BrokenAtOne(SlowReader):
        def read_layer(self, layer_idx, pinned=False):
            if layer_idx == 1:
                raise OSError("bad sector")
            return super().read_layer(layer_idx, pinned)

    source = StoreLayerSource([BrokenAtOne(0.0)], "cpu", torch.float32, _never_recover, True, prefetch_depth=2)
    source.layer(0)
    time.sleep(0.05)  # the thread reaches layer 1 and stops there
    with pytest.raises(OSError, match="bad sector"):
        source.layer(2)  # must raise, not wait forever for a layer the thread will never read
    source.close()


def test_default_pipelining_only_when_a_chunk_is_below_memory(engine, chunks, tmp_path):
    """Memory-tier reads are copies: no reader thread by default; disk or Redis ones are pipelined."""
    store = make_store(engine, tmp_path)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    assert {h.tier for h in handles} == {Tier.MEMORY}
    source = store.layer_source(handles, "cpu", torch.float32)
    assert not source.is_pipelined
    source.close()
    disk_only = make_store(engine, tmp_path, max_memory_bytes=0)
    disk_handles = [disk_only.handle(k) for k in keys]
    assert {h.tier for h in disk_handles} == {Tier.DISK}
    source = disk_only.layer_source(disk_handles, "cpu", torch.float32)
    assert source.is_pipelined
    source.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is a Linux scheduling policy")
@pytest.mark.parametrize("priority", list(LoaderPriority))
def test_the_pipelined_reader_thread_runs_at_its_configured_priority(engine, chunks, tmp_path, priority):
    """auto (beside a CPU engine) and idle: SCHED_IDLE, so the engine's threads keep the cores; the
    layers still all arrive (when the engine waits on one, the cores are the reader's) and equal memory's."""
    store = make_store(engine, tmp_path, max_memory_bytes=0, prefetch_depth=1, loader_priority=priority)
    handles = [store.handle(k) for k in put_all(store, chunks)]
    source = store.layer_source(handles, "cpu", torch.float32, start_layer=1)
    try:
        deadline = time.monotonic() + 10
        while source.stats.num_layers_loaded == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        # depth 1: it read layers 1 and 2 and waits for the engine to ask for layer 1
        (reader,) = [t for t in threading.enumerate() if t.name == "kv-prefetch" and t.is_alive()]
        expected = os.SCHED_OTHER if priority is LoaderPriority.NORMAL else os.SCHED_IDLE
        assert os.sched_getscheduler(reader.native_id) == expected
        result = engine.prefill(prompt(handles), mode=PrefillMode.BLEND, kv_source=source)
    finally:
        source.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the engine's own thread keeps its priority
    assert torch.equal(result.logits, engine.prefill(prompt(chunks), mode=PrefillMode.BLEND).logits)


def test_the_reader_is_idle_beside_a_cpu_engine_only_by_default():
    assert LoaderPriority.AUTO.is_idle_beside("cpu") and not LoaderPriority.AUTO.is_idle_beside("cuda")
    assert LoaderPriority.IDLE.is_idle_beside("cuda") and not LoaderPriority.NORMAL.is_idle_beside("cpu")


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is a Linux scheduling policy")
@pytest.mark.parametrize("priority, engine_device_type, is_idle", [
    (LoaderPriority.AUTO, "cpu", True), (LoaderPriority.AUTO, "cuda", False),
    (LoaderPriority.NORMAL, "cpu", False), (LoaderPriority.IDLE, "cuda", True),
])
def test_the_prefetch_thread_runs_at_the_readers_priority(engine, chunks, tmp_path, priority, engine_device_type,
                                                          is_idle):
    """The copy-up started at retrieval runs beside other requests' prefills: behind the engine's
    threads where the engine computes on the CPU (auto), and it still copies every chunk up."""
    store = make_store(engine, tmp_path, loader_priority=priority, engine_device_type=engine_device_type)
    keys = [store.key_for(kv.token_ids, kv.context_ids) for kv in chunks]
    for key, kv in zip(keys, chunks):
        store.backend(Tier.DISK).put(key, kv)  # on disk only: the prefetch has them to copy up
    try:
        assert store.prefetch(keys) == NUM_CHUNKS
        policies = []
        store._prefetcher._pool.submit(lambda: policies.append(os.sched_getscheduler(0))).result()
        store._prefetcher.wait()
        assert policies == [os.SCHED_IDLE if is_idle else os.SCHED_OTHER]
        assert all(store.backend(Tier.MEMORY).contains(k) for k in keys)
    finally:
        store.close()
