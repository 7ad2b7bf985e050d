"""Memory and disk tiers through the KVStore: round trips, restart, corruption, capacity and LRU."""

import os
from pathlib import Path

import pytest
import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from configs.settings import load_settings
from kv_store import KVStore, StoreConfig, Tier

FP = "fingerprint-a"
SHAPE = KVShape(num_layers=3, num_kv_heads=2, head_dim=8)  # random_kv's


def random_kv(seed=0, num_tokens=32, num_layers=3) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (num_layers, 2, num_tokens, 8)
    tokens = tuple(torch.randint(0, 1000, (num_tokens,), generator=g).tolist())
    return ChunkKV(tokens, (1,), torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def make_store(tmp_path: Path, fingerprint=FP, **kw) -> KVStore:
    kw.setdefault("dtype", StorageDtype.FLOAT32)
    kw.setdefault("disk_dir", tmp_path / "kv")
    kw.setdefault("fsync", False)
    kw.setdefault("quantization", KVQuantization.NONE)
    kw.setdefault("disk_enabled", kw["disk_dir"] is not None)
    return KVStore(fingerprint, StoreConfig(**kw), shape=SHAPE)


def put(store: KVStore, kv: ChunkKV) -> str:
    key = store.key_for(kv.token_ids, kv.context_ids)
    store.put(key, kv)
    return key


def disk_file(store: KVStore, key: str) -> Path:
    return store.backend(Tier.DISK).path(key)


@pytest.mark.parametrize("tier", [Tier.MEMORY, Tier.DISK])
def test_roundtrip_fp32_bit_exact_each_tier(tmp_path, tier):
    only = {Tier.MEMORY: dict(disk_dir=None), Tier.DISK: dict(max_memory_bytes=0)}[tier]
    store = make_store(tmp_path, **only)
    assert store.tiers == [tier]
    kv = random_kv()
    key = put(store, kv)
    out = store.get(key)
    assert torch.equal(out.keys, kv.keys) and torch.equal(out.values, kv.values)
    assert out.token_ids == kv.token_ids and store.contains(key)
    store.delete(key)
    assert store.get(key) is None and not store.contains(key)
    store.close()


def test_fp16_disk_within_rounding(tmp_path):
    store = make_store(tmp_path, max_memory_bytes=0, dtype=StorageDtype.FLOAT16)
    kv = random_kv()
    out = store.get(put(store, kv))
    assert out.keys.dtype == torch.float16 and torch.equal(out.keys, kv.keys.half())
    assert torch.allclose(out.values.float(), kv.values, atol=2e-3, rtol=1e-3)


def test_disk_hit_is_promoted_to_memory(tmp_path):
    store = make_store(tmp_path, write_tiers=frozenset({Tier.DISK}))
    key = put(store, random_kv())
    assert not store.backend(Tier.MEMORY).contains(key)
    assert store.get(key) is not None
    assert store.backend(Tier.MEMORY).contains(key)
    stats = store.stats().tiers
    assert stats["memory"].misses == 1 and stats["disk"].hits == 1 and stats["disk"].bytes_read > 0


def test_streamed_chunks_are_promoted_on_request(tmp_path):
    store = make_store(tmp_path, write_tiers=frozenset({Tier.DISK}))
    keys = [put(store, random_kv(seed)) for seed in range(3)]
    handles = [store.handle(k) for k in keys]
    assert {h.tier for h in handles} == {Tier.DISK}
    assert store.promote(handles) == 3
    assert [store.handle(k).tier for k in keys] == [Tier.MEMORY] * 3
    assert store.promote([store.handle(k) for k in keys]) == 0  # already in the fastest tier


def test_put_rejects_wrong_key_and_empty_chunk(tmp_path):
    store = make_store(tmp_path)
    kv = random_kv()
    with pytest.raises(ValueError, match="key_for"):
        store.put(store.key_for((9, 9)), kv)
    with pytest.raises(ValueError, match="not a chunk key"):
        store.get("../etc")
    empty = ChunkKV((), (), torch.zeros(3, 2, 0, 8), torch.zeros(3, 2, 0, 8))
    with pytest.raises(ValueError, match="empty"):
        store.put(store.key_for(()), empty)


def test_restart_same_directory_hits(tmp_path):
    kv = random_kv()
    store = make_store(tmp_path)
    key = put(store, kv)
    store.close()
    reopened = make_store(tmp_path)
    assert reopened.backend(Tier.MEMORY).bytes_used() == 0
    assert reopened.handle(key).tier == Tier.DISK
    assert torch.equal(reopened.get(key).keys, kv.keys)
    assert reopened.backend(Tier.DISK).bytes_used() == disk_file(reopened, key).stat().st_size


def test_other_fingerprint_never_shares_entries(tmp_path):
    kv = random_kv()
    key_a = put(make_store(tmp_path), kv)
    store_b = make_store(tmp_path, fingerprint="fingerprint-b")
    assert store_b.key_for(kv.token_ids, kv.context_ids) != key_a
    assert store_b.get(store_b.key_for(kv.token_ids, kv.context_ids)) is None


def _corrupt_flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # inside the last layer's tensor bytes
    path.write_bytes(bytes(data))


def _corrupt_truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def _corrupt_fingerprint(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data.replace(FP.encode(), b"fingerprint-x", 1))


def _corrupt_shapes(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"shape":[2,2,32,8]', b'"shape":[2,2,16,8]', 1))


def _corrupt_header_utf8(path: Path) -> None:
    """A byte that is not UTF-8 in the JSON header: the decode error's repr would carry the whole header."""
    data = path.read_bytes()
    path.write_bytes(data.replace(b"token_ids", b"token_id\xff", 1))


@pytest.mark.parametrize("damage", [_corrupt_flip, _corrupt_truncate, _corrupt_fingerprint, _corrupt_shapes,
                                    _corrupt_header_utf8])
def test_damaged_entry_is_a_miss_then_clean_recompute(tmp_path, damage, caplog):
    kv = random_kv()
    store = make_store(tmp_path, max_memory_bytes=0)
    key = put(store, kv)
    path = disk_file(store, key)
    damage(path)
    assert store.get(key) is None  # a miss, not an exception
    assert not path.exists(), "the damaged file must be deleted"
    assert store.stats().tiers["disk"].corrupt == 1
    assert "damaged" in caplog.text
    [line] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(line) < 400 and ",".join(map(str, kv.token_ids[:4])) not in line, line  # no header dump
    store.put(key, kv)  # the caller recomputes and stores again
    assert torch.equal(store.get(key).keys, kv.keys)


def test_memory_tier_bound_and_lru_order(tmp_path):
    kvs = [random_kv(seed=i) for i in range(5)]
    size = kvs[0].nbytes
    store = make_store(tmp_path, disk_enabled=False, max_memory_bytes=3 * size)
    mem = store.backend(Tier.MEMORY)
    keys = [put(store, kv) for kv in kvs[:3]]
    store.get(keys[0])  # 0 is now the most recently used: 1 goes first
    put(store, kvs[3])
    assert mem.bytes_used() <= 3 * size
    assert mem.keys_lru_order() == [keys[2], keys[0], store.key_for(kvs[3].token_ids, (1,))]
    assert not store.contains(keys[1])
    put(store, kvs[4])
    assert not store.contains(keys[2]) and mem.bytes_used() <= 3 * size
    assert store.stats().tiers["memory"].evictions == 2


def test_disk_tier_bound_and_lru_order_survive_restart(tmp_path):
    kvs = [random_kv(seed=i) for i in range(5)]
    store = make_store(tmp_path, max_memory_bytes=0)
    key0 = put(store, kvs[0])
    size = disk_file(store, key0).stat().st_size
    store.close()
    store = make_store(tmp_path, max_memory_bytes=0, max_disk_bytes=3 * size)
    keys = [key0] + [put(store, kv) for kv in kvs[1:3]]
    for i, key in enumerate(keys):  # distinct mtimes: file systems may have coarse timestamps
        os.utime(disk_file(store, key), (1000 + i, 1000 + i))
    store.close()
    store = make_store(tmp_path, max_memory_bytes=0, max_disk_bytes=3 * size)
    disk = store.backend(Tier.DISK)
    assert disk.keys_lru_order() == keys  # rebuilt from mtimes
    assert store.get(keys[0]) is not None  # touch: 0 becomes most recent
    put(store, kvs[3])
    assert not store.contains(keys[1]) and store.contains(keys[0])
    files = list((tmp_path / "kv").glob("??/*.safetensors"))
    assert sum(f.stat().st_size for f in files) <= 3 * size == disk.max_bytes
    assert len(files) == 3 and store.stats().tiers["disk"].evictions == 1


def test_entry_larger_than_a_tier_is_not_stored_there(tmp_path):
    kv = random_kv()
    store = make_store(tmp_path, max_memory_bytes=kv.nbytes - 1, max_disk_bytes=10)
    key = put(store, kv)
    assert not store.contains(key)
    assert store.backend(Tier.MEMORY).bytes_used() == 0 and store.backend(Tier.DISK).bytes_used() == 0


def test_int8_disk_tier_fidelity(tmp_path):
    kv = random_kv(num_tokens=128)
    store = make_store(tmp_path, max_memory_bytes=0, quantization=KVQuantization.INT8)
    key = put(store, kv)
    assert disk_file(store, key).stat().st_size < kv.nbytes / 3  # int8 vs the fp32 source
    out = store.get(key)
    rel = (out.keys.float() - kv.keys).norm() / kv.keys.norm()
    assert 0 < rel < 0.02


def test_the_settings_section_resolved_paths_and_tiers(tmp_path, monkeypatch):
    settings = load_settings(data_dir=tmp_path)
    store = KVStore(FP, settings.store.resolved(settings.data_dir), shape=SHAPE)
    assert store.tiers == [Tier.MEMORY, Tier.DISK]  # no Redis without a URL
    assert store.config.disk_dir == tmp_path / "kv" and (tmp_path / "kv").is_dir()
    monkeypatch.setenv("RAGBLEND_STORE__DISK_ENABLED", "false")
    monkeypatch.setenv("RAGBLEND_STORE__DTYPE", "bfloat16")
    store = KVStore(FP, load_settings(data_dir=tmp_path).store.resolved(tmp_path), shape=SHAPE)
    assert store.tiers == [Tier.MEMORY] and store.config.dtype == StorageDtype.BFLOAT16


def test_config_rejects_bad_bounds():
    with pytest.raises(ValueError, match="min_recompute_ratio"):
        StoreConfig(quantization=KVQuantization.NONE, disk_enabled=False, min_recompute_ratio=0.5, max_recompute_ratio=0.2)
    with pytest.raises(ValueError, match="prefetch_depth"):
        StoreConfig(quantization=KVQuantization.NONE, disk_enabled=False, prefetch_depth=0)


def test_get_many_reads_each_tier_once_for_the_missing(tmp_path):
    kvs = [random_kv(seed=i) for i in range(3)]
    store = make_store(tmp_path, write_tiers=frozenset({Tier.DISK}))
    keys = [put(store, kv) for kv in kvs]
    store.get(keys[0])  # now in memory too
    out = store.get_many(keys + [store.key_for((5, 6), (1,))])
    assert [torch.equal(o.keys, kv.keys) for o, kv in zip(out, kvs)] == [True] * 3 and out[3] is None
    tiers = store.stats().tiers
    assert tiers["memory"].hits == 1 and tiers["disk"].hits == 3  # 1 by get, 2 by get_many
