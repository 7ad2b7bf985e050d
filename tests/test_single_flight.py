"""Single-flight KV precompute across replicas (kv_store/single_flight.py): two "replicas" (each its own
KV store client and lock connection) on one real redis-server; the first is made to compute slowly so
the second's call overlaps it for certain."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from blend_engine.kv import ChunkKV, KVShape
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig
from kv_store.single_flight import PrecomputeLocks, PrecomputeOutcome, PrecomputeReason, SingleFlight

try:
    from tests.redis_server import start_or_skip
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from redis_server import start_or_skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_or_skip(tmp_path_factory.mktemp("redis"))
    yield srv
    srv.stop()


def _kv(num_tokens: int = 12) -> ChunkKV:
    g = torch.Generator().manual_seed(0)
    shape = (2, 2, num_tokens, 8)
    return ChunkKV(tuple(range(num_tokens)), (1,), torch.randn(shape, generator=g), torch.randn(shape, generator=g))


def _replica(server, ttl_s: float = 30.0) -> tuple[SingleFlight, KVStore, list]:
    store = KVStore("fp-single-flight", StoreConfig(quantization=KVQuantization.NONE, max_memory_bytes=0, disk_enabled=False, redis_url=server.url,
                                                    dtype=StorageDtype.FLOAT32), shape=KVShape(2, 2, 8))
    outcomes: list = []
    flight = SingleFlight(store, PrecomputeLocks(server.url, ttl_s), lambda r, o: outcomes.append((r, o)))
    return flight, store, outcomes


def _race(server, second_reason: PrecomputeReason):
    (a, store_a, _), (b, store_b, _) = _replica(server), _replica(server)
    kv = _kv()
    key = store_a.key_for(kv.token_ids, kv.context_ids)
    store_a.delete(key)
    is_computing, num_computed = threading.Event(), []

    def slow_compute() -> ChunkKV:
        is_computing.set()
        time.sleep(0.5)
        num_computed.append("a")
        return kv

    def compute_b() -> ChunkKV:
        num_computed.append("b")
        return kv

    results = {}
    thread = threading.Thread(target=lambda: results.update(a=a.ensure(key, slow_compute, PrecomputeReason.INGEST)))
    thread.start()
    assert is_computing.wait(10)
    results["b"] = b.ensure(key, compute_b, second_reason)
    thread.join(10)
    return results, num_computed, store_b.readable_many([key])[0]


def test_an_ingest_waits_for_the_replica_computing_the_same_chunk(server):
    results, num_computed, is_readable = _race(server, PrecomputeReason.INGEST)
    assert results == {"a": PrecomputeOutcome.COMPUTED, "b": PrecomputeOutcome.FOUND}
    assert num_computed == ["a"] and is_readable  # one precompute; B returned once A's entry was in Redis


@pytest.mark.parametrize("reason", [PrecomputeReason.REPAIR, PrecomputeReason.BACKFILL])
def test_background_work_leaves_a_chunk_to_the_replica_computing_it(server, reason):
    results, num_computed, _ = _race(server, reason)
    assert results == {"a": PrecomputeOutcome.COMPUTED, "b": PrecomputeOutcome.SKIPPED}
    assert num_computed == ["a"]


def test_a_lock_whose_holder_died_expires_and_the_chunk_is_computed(server):
    (a, store, outcomes) = _replica(server, ttl_s=0.3)
    kv = _kv(7)
    key = store.key_for(kv.token_ids, kv.context_ids)
    assert PrecomputeLocks(server.url, 0.3).acquire(key) is not None  # a replica that dies holding it
    start = time.monotonic()
    assert a.ensure(key, lambda: kv, PrecomputeReason.INGEST) is PrecomputeOutcome.COMPUTED
    assert 0.2 < time.monotonic() - start < 5 and store.readable_many([key]) == [True]
    assert outcomes == [(PrecomputeReason.INGEST, PrecomputeOutcome.COMPUTED)]


def test_without_redis_every_precompute_runs():
    class Entries:  # the smallest KV store SingleFlight talks to, for the no-Redis path only
        def __init__(self):
            self.puts = []

        def readable_many(self, keys):
            return [False] * len(keys)

        def put(self, key, kv, salt=""):
            self.puts.append(key)

    entries = Entries()
    flight = SingleFlight(entries, PrecomputeLocks(None, 1.0))
    assert flight.ensure("k", lambda: "kv", PrecomputeReason.INGEST) is PrecomputeOutcome.COMPUTED
    assert flight.ensure("k", lambda: "kv", PrecomputeReason.REPAIR) is PrecomputeOutcome.COMPUTED
    assert entries.puts == ["k", "k"]
