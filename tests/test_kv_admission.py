"""The collection's KV budget rule (kv_store/admission.py) on a real disk tier: ingestion writes into
free room only, a chunk computed after a miss is admitted only when it is used more than everything
it would evict, and use counts fade with recency."""

import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization
from kv_store import Admission, KVStore, StoreConfig
from kv_store.admission import AdmissionPolicy


def chunk(seed: int, num_tokens: int = 32) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 2, num_tokens, 16)
    tokens = tuple(torch.randint(0, 1000, (num_tokens,), generator=g).tolist())
    return ChunkKV(tokens, (), torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def store_for(tmp_path, num_entries: float, **config) -> tuple[KVStore, list]:
    probe = KVStore("fp", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=0, disk_dir=tmp_path / "probe"), shape=KVShape(2, 2, 16))
    kv = chunk(0)
    probe.put(probe.key_for(kv.token_ids), kv)
    size = probe.backend("disk").bytes_used()
    probe.close()
    config.setdefault("quantization", KVQuantization.NONE)
    store = KVStore("fp", StoreConfig(max_memory_bytes=1 << 20, disk_dir=tmp_path / "kv",
                                      max_disk_bytes=int(num_entries * size), **config), shape=KVShape(2, 2, 16))
    kvs = [chunk(i) for i in range(6)]
    return store, [(store.key_for(kv.token_ids), kv) for kv in kvs]


def test_precompute_fills_free_room_only_and_the_memory_tier_while_it_has_room(tmp_path):
    store, entries = store_for(tmp_path, 3.5)
    written = [store.offer(key, kv, Admission.PRECOMPUTE) for key, kv in entries]
    assert written == [True, True, True, False, False, False]
    assert store.backend("disk").bytes_used() <= store.config.max_disk_bytes
    # the admitted ones are copied up too (1 MiB of memory tier: room for all), the refused ones nowhere
    assert [store.backend("memory").contains(key) for key, _ in entries] == written
    assert store.should_compute(entries[4][0], 32, Admission.PRECOMPUTE) is False  # not even computed
    stats = store.budget_stats()
    assert (stats.admitted, stats.rejected, stats.evictions) == (3, 4, 0)


def test_a_miss_is_cached_only_when_it_beats_what_it_would_evict(tmp_path):
    store, entries = store_for(tmp_path, 3.5)
    for key, kv in entries[:3]:
        store.offer(key, kv, Admission.PRECOMPUTE)
    hot = [key for key, _ in entries[:3]]
    for _ in range(3):
        for key in hot:
            assert store.handle(key) is not None  # used: hits
    cold_key, cold_kv = entries[3]
    assert store.handle(cold_key) is None  # one use, a miss
    assert not store.offer(cold_key, cold_kv, Admission.USE)  # 1 use < 3 uses of the LRU victim
    for _ in range(3):
        store.handle(cold_key)
    assert store.offer(cold_key, cold_kv, Admission.USE)  # 4 uses beat 3: it evicts the LRU one
    assert store.contains(cold_key) and store.backend("disk").bytes_used() <= store.config.max_disk_bytes
    assert store.budget_stats().evictions == 1 and store.budget_stats().misses == 4


def test_unbudgeted_writes_everything_and_lru_evicts(tmp_path):
    store, entries = store_for(tmp_path, 3.5, budgeted=False)
    assert all(store.offer(key, kv, Admission.PRECOMPUTE) for key, kv in entries)
    assert store.contains(entries[-1][0]) and not store.backend("disk").contains(entries[0][0])


def test_use_counts_halve_every_half_life():
    class Tier:
        def bytes_used(self):
            return 0

    policy = AdmissionPolicy(Tier(), 100, half_life_uses=4)
    policy.note_uses(["a"] * 4, [True] * 4)
    before = policy.score("a")
    policy.note_uses(["b"] * 4, [True] * 4)
    assert abs(policy.score("a") - before / 2) < 1e-9


def test_a_precompute_evicts_nothing_from_the_memory_tier_and_copies_what_the_disk_gives(tmp_path):
    """Ingestion copies an entry into the memory tier only while it has room (a hot entry there is never
    evicted for a new document's); the copy is read back from disk, so an int4 entry holds the values a
    read from disk gives, not the fp16 ones computed."""
    kvs = [chunk(i) for i in range(3)]
    one_entry = 2 * 2 * 2 * 32 * 16 * 2  # keys + values [L=2, H=2, n=32, D=16] in fp16
    store = KVStore("fp", StoreConfig(max_memory_bytes=one_entry + one_entry // 2, disk_dir=tmp_path / "kv",
                                      quantization=KVQuantization.INT4), shape=KVShape(2, 2, 16))
    keys = [store.key_for(kv.token_ids) for kv in kvs]
    for key, kv in zip(keys, kvs):
        assert store.offer(key, kv, Admission.PRECOMPUTE)
    memory, disk = store.backend("memory"), store.backend("disk")
    assert [memory.contains(k) for k in keys] == [True, False, False]  # the first fits; none evicts it
    assert all(disk.contains(k) for k in keys)
    in_memory, from_disk = memory.get(keys[0]), disk.get(keys[0])
    assert torch.equal(in_memory.keys, from_disk.keys) and torch.equal(in_memory.values, from_disk.values)
    assert not torch.equal(in_memory.keys, kvs[0].keys.half())  # int4's values, not the computed ones
    store.close()
