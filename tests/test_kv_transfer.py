"""Layers leave their tier as stored: a disk layer's K and V in one copy, int8 entries as int8,
dequantized on the target device (after the move). What arrives equals the host-side order of before,
layer by layer and in a prefill."""

from __future__ import annotations

import pytest
import torch

from blend_engine.kv import ChunkKV, KVShape
from blend_engine.types import PrefillMode, Segment
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier
from kv_store.codec import QuantizedLayer, StackedLayer
from tests.engine_models import build_engine


def int8_disk_store(tmp_path, dtype: StorageDtype, shape: KVShape, **kw) -> KVStore:
    return KVStore("fp", StoreConfig(max_memory_bytes=0, disk_dir=tmp_path, fsync=False, dtype=dtype,
                                     quantization=KVQuantization.INT8, **kw), shape=shape)


@pytest.mark.parametrize("dtype", [StorageDtype.FLOAT16, StorageDtype.FLOAT32])
def test_int8_layers_cross_as_int8_and_dequantize_to_what_the_host_gave(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 2, 24, 8, generator=g)  # [L=3, H=2, n=24, D=8] each
    kv = ChunkKV(tuple(range(24)), (), keys, values)
    store = int8_disk_store(tmp_path, dtype, kv.shape)
    key = store.key_for(kv.token_ids)
    store.put(key, kv)
    reader = store.backend(Tier.DISK).open_reader(key)
    encoded = reader.read_layer_encoded(1)
    assert isinstance(encoded, QuantizedLayer) and encoded.q.dtype == torch.int8  # what crosses PCIe
    assert encoded.q.nbytes + encoded.scale.nbytes == reader.info.layer_nbytes
    host_k, host_v = reader.read_layer(1)  # the order of before: dequantized on the host
    reader.close()
    for engine_dtype in (torch.float32, torch.bfloat16):
        source = store.layer_source([store.handle(key)], "cpu", engine_dtype, pipelined=False)
        (got_k, got_v), = source.layer(1)
        source.close()
        assert got_k.dtype == engine_dtype
        assert torch.equal(got_k, host_k.to(engine_dtype)) and torch.equal(got_v, host_v.to(engine_dtype))
    store.close()


def test_prefill_from_int8_disk_equals_the_host_dequantized_kv_in_memory(tmp_path):
    engine = build_engine("llama-gqa")
    parts = [tuple(range(10 + 20 * i, 30 + 20 * i)) for i in range(2)]
    store = int8_disk_store(tmp_path, StorageDtype.FLOAT32, engine.kv_shape)
    keys = [store.key_for(p) for p in parts]
    for key, p in zip(keys, parts):
        store.put(key, engine.precompute(p))
    dequantized = [store.get(k) for k in keys]  # the whole-entry read: dequantized on the host
    handles = [store.handle(k) for k in keys]
    question = Segment(tuple(range(200, 208)))
    for pipelined in (False, True):
        source = store.layer_source(handles, "cpu", torch.float32, pipelined=pipelined)
        got = engine.prefill([Segment(p, h) for p, h in zip(parts, handles)] + [question], PrefillMode.REUSE,
                             kv_source=source)
        source.close()
        reference = engine.prefill([Segment(p, kv) for p, kv in zip(parts, dequantized)] + [question],
                                   PrefillMode.REUSE)
        assert torch.equal(got.logits, reference.logits)
    store.close()


def test_the_move_comes_before_the_dequantize(tmp_path, monkeypatch):
    """On a "meta" target (no data, any host): the dequantize sees int8 tensors already on the target."""
    kv = ChunkKV(tuple(range(8)), (), torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4))
    store = int8_disk_store(tmp_path, StorageDtype.FLOAT16, kv.shape)
    key = store.key_for(kv.token_ids)
    store.put(key, kv)
    seen: list[tuple[torch.device, torch.dtype]] = []
    unpack = QuantizedLayer.unpack
    monkeypatch.setattr(QuantizedLayer, "unpack", lambda self: seen.append((self.q.device, self.q.dtype))
                        or unpack(self))
    source = store.layer_source([store.handle(key)], "meta", torch.float16, pipelined=False)
    (k, _), = source.layer(0)
    source.close()
    assert seen == [(torch.device("meta"), torch.int8)] and k.device == torch.device("meta")
    store.close()


def test_a_disk_layer_moves_keys_and_values_in_one_copy(tmp_path, monkeypatch):
    kv = ChunkKV(tuple(range(8)), (), torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4))
    store = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=0, disk_dir=tmp_path, fsync=False,
                                      dtype=StorageDtype.FLOAT16), shape=kv.shape)
    key = store.key_for(kv.token_ids)
    store.put(key, kv)
    moves: list[torch.Size] = []
    to = StackedLayer.to
    monkeypatch.setattr(StackedLayer, "to", lambda self, *a, **kw: moves.append(self.kv.shape) or to(self, *a, **kw))
    source = store.layer_source([store.handle(key), store.handle(key)], "cpu", torch.float32, pipelined=False)
    got = source.layer(1)
    source.close()
    assert moves == [torch.Size([2, 2, 8, 4])] * 2  # one per chunk-layer: [2 (K, V), H, n, D]
    reader = store.backend(Tier.DISK).open_reader(key)
    host_k, host_v = reader.read_layer(1)
    reader.close()
    assert torch.equal(got[0][0], host_k.float()) and torch.equal(got[1][1], host_v.float())
    store.close()


def test_a_memory_layer_moves_keys_and_values_in_one_copy(monkeypatch):
    """The memory tier holds each entry as one [L, 2, H, n, D] block: a layer's K and V are adjacent,
    handed over without a copy and moved in one (pinned once at put on CUDA hosts)."""
    kv = ChunkKV(tuple(range(8)), (), torch.randn(3, 2, 8, 4), torch.randn(3, 2, 8, 4))
    store = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, disk_enabled=False, max_memory_bytes=1 << 20, dtype=StorageDtype.FLOAT16), shape=kv.shape)
    key = store.key_for(kv.token_ids)
    store.put(key, kv)
    stored = store.get(key)
    assert torch.equal(stored.keys.float(), kv.keys.half().float()) and torch.equal(stored.values.float(), kv.values.half().float())
    layer = store.backend(Tier.MEMORY).open_reader(key).read_layer_encoded(1)
    assert isinstance(layer, StackedLayer) and layer.kv.is_contiguous()
    assert layer.kv.data_ptr() == stored.keys[1].data_ptr()  # a view of the entry, no copy on the way
    moves: list[torch.Size] = []
    to = StackedLayer.to
    monkeypatch.setattr(StackedLayer, "to", lambda self, *a, **kw: moves.append(self.kv.shape) or to(self, *a, **kw))
    source = store.layer_source([store.handle(key)], "cpu", torch.float32, pipelined=False)
    got = source.layer(2)
    source.close()
    assert moves == [torch.Size([2, 2, 8, 4])]
    assert torch.equal(got[0][0], stored.keys[2].float()) and torch.equal(got[0][1], stored.values[2].float())
    store.close()


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_int4_layer_streamed_from_disk_equals_its_promoted_copy_in_memory(tmp_path, pipelined):
    """The disk tier decodes a low-bit layer in fp32 on the host; its copy promoted to the memory tier is
    stored in the storage dtype (fp16). Both hand the engine the same values, so an answer does not
    change with the tier its KV came from (a cold first ask, then warm ones)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 2, 40, 16, generator=g)  # [L=3, H=2, n=40, D=16] each
    kv = ChunkKV(tuple(range(40)), (), keys, values)
    store = KVStore("fp", StoreConfig(disk_dir=tmp_path, fsync=False, quantization=KVQuantization.INT4,
                                      write_tiers=frozenset({Tier.DISK})), shape=kv.shape)
    key = store.key_for(kv.token_ids)
    store.put(key, kv)

    def streamed():
        handle = store.handle(key)
        source = store.layer_source([handle], "cpu", torch.float32, pipelined=pipelined)
        layers = [source.layer(i)[0] for i in range(3)]  # [(keys, values) [H, n, D]] per layer
        source.close()
        return handle, layers

    handle, cold = streamed()
    assert handle.tier is Tier.DISK
    assert store.promote([handle]) == 1
    warm_handle, warm = streamed()
    assert warm_handle.tier is Tier.MEMORY
    for (cold_k, cold_v), (warm_k, warm_v) in zip(cold, warm):
        assert torch.equal(cold_k, warm_k) and torch.equal(cold_v, warm_v)
    store.close()
