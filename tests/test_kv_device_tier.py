"""The GPU tier (kv_store/device.py), run on device "cpu" here: an LRU by bytes above the memory tier,
filled by reads from slower tiers, serving reads itself; its settings; the memory tier's pinning."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from blend_engine.kv import ChunkKV, KVShape
from blend_engine.types import BlendConfig, PrefillMode, Segment
from configs.settings import load_settings
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier
from kv_store.device import DeviceBackend, default_gpu_bytes
from kv_store.memory import MemoryBackend
from tests.engine_models import build_engine

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPE = KVShape(2, 2, 4)  # the chunks these tests store (any shape: the tiers hold what they are given)


def chunk(seed: int, num_tokens: int = 8) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, 2, 2, num_tokens, 4, generator=g)  # [L=2, H=2, n, D=4] each
    return ChunkKV(tuple(range(seed, seed + num_tokens)), (), keys, values)


def device_store(tmp_path, max_gpu_bytes: int = 1 << 20) -> KVStore:
    return KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_gpu_bytes=max_gpu_bytes, gpu_device="cpu", max_memory_bytes=1 << 20,
                                     disk_dir=tmp_path, fsync=False, dtype=StorageDtype.FLOAT32,
                                     write_tiers=frozenset({Tier.DISK})), shape=KVShape(2, 2, 4))


def test_device_tier_is_an_lru_by_bytes():
    kvs = [chunk(i) for i in range(3)]
    tier = DeviceBackend(2 * kvs[0].nbytes, torch.float32, "cpu")
    tier.put("a", kvs[0])
    tier.put("b", kvs[1])
    assert tier.get("a") is not None  # "a" is now the most recently used
    tier.put("c", kvs[2])
    assert tier.keys_lru_order() == ["a", "c"] and tier.bytes_used() == 2 * kvs[0].nbytes
    assert tier.counters.snapshot(0).evictions == 1
    assert torch.equal(tier.get("c").keys, kvs[2].keys) and tier.get("c").keys.device == torch.device("cpu")
    tier.put("big", chunk(9, num_tokens=64))  # larger than the whole tier: not stored, nothing evicted
    assert tier.keys_lru_order() == ["a", "c"]
    tier.delete("a")
    assert tier.readable_many(["a", "c"]) == [False, True] and tier.bytes_used() == kvs[0].nbytes


def test_a_hit_on_a_slower_tier_is_promoted_into_the_device_tier_and_served_from_it(tmp_path):
    store = device_store(tmp_path)
    assert store.tiers == [Tier.GPU, Tier.MEMORY, Tier.DISK]
    kv = chunk(1)
    key = store.key_for(kv.token_ids)
    store.put(key, kv)  # written to disk only
    assert store.handle(key).tier is Tier.DISK
    assert torch.equal(store.get(key).keys, kv.keys)  # a read through: copied up into memory and the GPU tier
    assert store.backend(Tier.GPU).contains(key) and store.backend(Tier.MEMORY).contains(key)
    disk_hits = store.stats().tiers["disk"].hits
    got = store.get(key)
    assert torch.equal(got.values, kv.values)
    assert store.stats().tiers["disk"].hits == disk_hits and store.stats().tiers["gpu"].hits == 1
    assert store.handle(key).tier is Tier.GPU
    store.close()


def test_promote_copies_memory_tier_chunks_up_into_the_device_tier(tmp_path):
    store = device_store(tmp_path)
    kv = chunk(2)
    key = store.key_for(kv.token_ids)
    store.backend(Tier.MEMORY).put(key, kv)
    handle = store.handle(key)
    assert handle.tier is Tier.MEMORY
    assert store.promote([handle]) == 1 and store.handle(key).tier is Tier.GPU
    assert store.collect_garbage(set()) >= 1 and not store.backend(Tier.GPU).contains(key)
    store.close()


def test_prefill_streamed_from_the_device_tier_equals_memory(tmp_path):
    engine = build_engine("llama-gqa")
    parts = [tuple(range(10 + 20 * i, 30 + 20 * i)) for i in range(2)]
    kvs = [engine.precompute(p) for p in parts]
    store = device_store(tmp_path, max_gpu_bytes=1 << 24)
    keys = [store.key_for(p) for p in parts]
    for key, kv in zip(keys, kvs):
        store.backend(Tier.GPU).put(key, kv)
    handles = [store.handle(k) for k in keys]
    assert [h.tier for h in handles] == [Tier.GPU, Tier.GPU]
    question = Segment(tuple(range(200, 208)))
    blend = BlendConfig.cacheblend(recompute_ratio=0.3)
    source = store.layer_source(handles, "cpu", torch.float32, start_layer=1)
    assert not source.is_pipelined  # views on the engine's device: nothing to hide
    got = engine.prefill([Segment(p, h) for p, h in zip(parts, handles)] + [question], PrefillMode.BLEND, blend,
                         kv_source=source)
    source.close()
    reference = engine.prefill([Segment(p, kv) for p, kv in zip(parts, kvs)] + [question], PrefillMode.BLEND, blend)
    assert torch.equal(got.logits, reference.logits)
    store.close()


def test_settings_enable_the_device_tier_only_explicitly_off_cuda(tmp_path):
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    store = KVStore("fp", load_settings(data_dir=tmp_path).store.resolved(tmp_path), device_type, shape=SHAPE)
    assert (Tier.GPU in store.tiers) is torch.cuda.is_available()  # by default: on with CUDA, off without
    store.close()
    on_cpu = load_settings(data_dir=tmp_path, store={"gpu_device": "cpu", "max_gpu_bytes": 4096}).store
    store = KVStore("fp", on_cpu.resolved(tmp_path), shape=SHAPE)
    assert store.backend(Tier.GPU).max_bytes == 4096 and on_cpu.gpu_device == "cpu"
    store.close()
    with pytest.raises(ValidationError, match="for tests: give max_gpu_bytes"):
        load_settings(store={"gpu_device": "cpu"})
    for bad in ({"gpu_device": "tpu", "max_gpu_bytes": 1}, {"gpu_memory_share": 1.5}, {"max_gpu_bytes": -1}):
        with pytest.raises(ValidationError):
            load_settings(store=bad)
    assert default_gpu_bytes(0.2, "cuda", is_model_on_cuda=False) == 0
    if not torch.cuda.is_available():
        assert default_gpu_bytes(0.2, "cuda", is_model_on_cuda=True) == 0
        with pytest.raises(ValueError, match="CUDA is not available"):
            KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, disk_enabled=False, max_gpu_bytes=1 << 20,
                                      gpu_device="cuda"), shape=SHAPE)


def test_memory_tier_pins_only_where_cuda_is():
    tier = MemoryBackend(1 << 20, torch.float32)
    tier.put("a", chunk(3))
    assert tier.is_pinned is torch.cuda.is_available()
    assert tier.get("a").keys.is_pinned() is torch.cuda.is_available()


@needs_cuda
def test_memory_tier_pins_once_at_put_and_reads_without_copying():
    tier = MemoryBackend(1 << 20, torch.float16)
    tier.put("a", chunk(4))
    stored = tier.get("a")
    assert stored.keys.is_pinned() and stored.values.is_pinned()
    k, _ = tier.open_reader("a").read_layer(1, pinned=True)
    assert k.data_ptr() == stored.keys[1].data_ptr()  # a view of the pinned entry, no per-read copy


@needs_cuda
def test_device_tier_holds_entries_on_cuda():
    tier = DeviceBackend(1 << 20, torch.float16, "cuda")
    tier.put("a", chunk(5))
    assert tier.get("a").keys.is_cuda and tier.get("a").keys.dtype == torch.float16
