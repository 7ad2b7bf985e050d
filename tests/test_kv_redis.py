"""The Redis tier against a real redis-server on a loopback port (skipped only if none can start)."""

import pytest
import redis
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blend_engine.config import BlendConfig
from blend_engine.engine import BlendEngine
from blend_engine.kv import ChunkKV, KVShape
from blend_engine.types import PrefillMode, Segment
from configs.enums import KVQuantization, StorageDtype
from kv_store import EntryLostError, KVStore, StoreConfig, Tier
from kv_store.redis_backend import KEY_PREFIX

try:
    from tests.redis_server import start_or_skip
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from redis_server import start_or_skip

FP = "fingerprint-r"
SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8)  # random_kv's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_or_skip(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    c = redis.Redis.from_url(server.url)
    c.flushall()
    yield c
    c.close()


def random_kv(seed=0, num_tokens=30) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (3, 2, num_tokens, 8)
    return ChunkKV(tuple(range(seed, seed + num_tokens)), (1,), torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def redis_only(server, fingerprint=FP, **kw) -> KVStore:
    kw.setdefault("dtype", StorageDtype.FLOAT32)
    kw.setdefault("quantization", KVQuantization.NONE)
    return KVStore(fingerprint, StoreConfig(max_memory_bytes=0, disk_enabled=False, redis_url=server.url, **kw), shape=SHAPE)


def put(store, kv) -> str:
    key = store.key_for(kv.token_ids, kv.context_ids)
    store.put(key, kv)
    return key


def test_roundtrip_bit_exact_binary_value_with_ttl(server, client):
    store = redis_only(server, redis_ttl_s=3600)
    assert store.tiers == [Tier.REDIS]
    kv = random_kv()
    key = put(store, kv)
    assert 0 < client.ttl(KEY_PREFIX + key) <= 3600
    assert client.get(KEY_PREFIX + key)[8:9] == b"{"  # a safetensors blob, stored as bytes
    out = store.get(key)
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)
    assert store.contains(key)
    store.delete(key)
    assert not store.contains(key) and store.get(key) is None
    assert store.stats().tiers["redis"].hits == 1
    store.close()


def test_fp16_and_int8_within_rounding(server, client):
    kv = random_kv(num_tokens=100)
    out = redis_only(server, dtype=StorageDtype.FLOAT16).get(put(redis_only(server, dtype=StorageDtype.FLOAT16), kv))
    assert torch.equal(out.values, kv.values.half())
    store = redis_only(server, quantization=KVQuantization.INT8)
    out = store.get(put(store, kv))
    assert (out.keys - kv.keys).norm() / kv.keys.norm() < 0.02


def test_shared_between_replicas_and_promoted(server, client, tmp_path):
    kv = random_kv()
    key = put(redis_only(server), kv)  # replica A writes
    replica_b = KVStore(FP, StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32, disk_dir=tmp_path, redis_url=server.url, fsync=False),
                        shape=SHAPE)
    assert replica_b.handle(key).tier == Tier.REDIS
    assert torch.equal(replica_b.get(key).keys, kv.keys)
    assert replica_b.backend(Tier.MEMORY).contains(key) and replica_b.backend(Tier.DISK).contains(key)
    assert replica_b.handle(key).tier == Tier.MEMORY


def test_other_fingerprint_or_damaged_value_is_a_miss(server, client):
    kv = random_kv()
    key = put(redis_only(server), kv)
    blob = bytearray(client.get(KEY_PREFIX + key))
    other = redis_only(server, fingerprint="other")
    client.set(KEY_PREFIX + other.key_for(kv.token_ids, kv.context_ids), bytes(blob))  # a foreign entry
    assert other.get(other.key_for(kv.token_ids, kv.context_ids)) is None
    blob[-2] ^= 0xFF
    client.set(KEY_PREFIX + key, bytes(blob))
    store = redis_only(server)
    assert store.get(key) is None and client.exists(KEY_PREFIX + key) == 0
    assert store.stats().tiers["redis"].corrupt == 1
    client.set(KEY_PREFIX + key, bytes(blob[:100]))  # truncated
    assert store.get(key) is None and store.handle(key) is None


def test_streamed_prefill_from_redis_matches_memory(server, client):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    engine = BlendEngine.from_model(LlamaForCausalLM(config), name="tiny-llama", blend=BlendConfig.cacheblend())
    chunks = [engine.precompute(tuple(range(10 * i + 2, 10 * i + 40)), (1,)) for i in range(3)]
    store = KVStore(engine.fingerprint, StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32, max_memory_bytes=0, disk_enabled=False,
                                                    redis_url=server.url), shape=engine.kv_shape)
    handles = [store.handle(put(store, kv)) for kv in chunks]
    expected = engine.prefill([Segment((3, 4))] + [Segment(c.token_ids, c) for c in chunks])
    for pipelined in (False, True):
        source = store.layer_source(handles, "cpu", torch.float32, pipelined=pipelined, start_layer=1)
        result = engine.prefill([Segment((3, 4))] + [Segment(h.token_ids, h) for h in handles], mode=PrefillMode.BLEND,
                                kv_source=source)
        source.close()
        assert torch.equal(result.logits, expected.logits)
    assert store.stats().tiers["redis"].bytes_read > 0


def test_server_restart_mid_run_is_a_miss_not_a_crash(server, client, tmp_path, caplog):
    kv = random_kv()
    store = redis_only(server)
    key = put(store, kv)
    handle = store.handle(key)
    server.stop()
    assert store.get(key) is None  # unreachable: a miss
    assert store.handle(key) is None and not store.contains(key)
    store.put(key, kv)  # dropped with a warning
    with pytest.raises(EntryLostError, match="no recompute"):  # streaming from a dead tier, no fallback
        store.layer_source([handle], "cpu", torch.float32, pipelined=False).layer(0)
    source = store.layer_source([handle], "cpu", torch.float32, pipelined=True,
                                recompute=lambda t, c: kv)  # with a fallback: recomputed
    assert torch.equal(source.layer(2)[0][0], kv.keys[2])
    source.close()
    assert store.stats().tiers["redis"].errors >= 3 and "redis" in caplog.text
    server.start()  # same port, empty (no persistence): the client reconnects by itself
    assert store.get(key) is None
    store.put(key, kv)
    assert torch.equal(store.get(key).keys, kv.keys)


def test_get_many_is_batched_and_promotes(server, client, tmp_path):
    kvs = [random_kv(seed) for seed in range(3)]
    remote = redis_only(server)
    keys = [put(remote, kv) for kv in kvs]
    store = KVStore(FP, StoreConfig(quantization=KVQuantization.NONE, dtype=StorageDtype.FLOAT32, disk_enabled=False, redis_url=server.url), shape=SHAPE)
    absent = store.key_for((999,), (1,))
    out = store.get_many([keys[0], absent, keys[2], keys[0]])
    assert out[1] is None and torch.equal(out[2].keys, kvs[2].keys) and torch.equal(out[3].values, kvs[0].values)
    assert store.backend(Tier.MEMORY).contains(keys[2]) and not store.backend(Tier.MEMORY).contains(keys[1])
    assert store.stats().tiers["redis"].hits == 2  # keys[0] fetched once
