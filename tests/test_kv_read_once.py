"""A chunk is read once per request: handle -> layer_source -> promote (and a prefetch started at
retrieval) parse each entry's header once and read each layer's bytes once; Redis streams layer i of
every chunk in one round trip; the promoted entry is exactly what was streamed."""

import threading
from collections import Counter

import pytest
import redis
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blend_engine.config import BlendConfig
from blend_engine.engine import BlendEngine
from blend_engine.types import PrefillMode, Segment
from configs.enums import KVQuantization, StorageDtype
from kv_store import KVStore, StoreConfig, Tier, codec

try:
    from tests.redis_server import start_or_skip
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from redis_server import start_or_skip

NUM_CHUNKS, CHUNK_TOKENS, NUM_LAYERS = 3, 24, 4


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=128, vocab_size=256)
    return BlendEngine.from_model(LlamaForCausalLM(config), name="tiny-llama", blend=BlendConfig.cacheblend())


@pytest.fixture(scope="module")
def chunks(engine):
    return [engine.precompute(tuple(range(2 + 30 * i, 2 + 30 * i + CHUNK_TOKENS)), (1,)) for i in range(NUM_CHUNKS)]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = start_or_skip(tmp_path_factory.mktemp("redis"))
    redis.Redis.from_url(server.url).flushall()
    yield server.url
    server.stop()


class ReadCounter:
    """Counts header parses per key and verified layer reads per (key, layer), on every tier."""

    def __init__(self, monkeypatch):
        self.parses, self.layers = Counter(), Counter()
        # every layer read verifies its bytes in decode_layer_encoded (decode_layer unpacks its result)
        real_parse, real_decode = codec.parse_header, codec.decode_layer_encoded

        def parse_header(head, total, key, *args):
            self.parses[key] += 1
            return real_parse(head, total, key, *args)

        def decode_layer_encoded(header, layer_idx, buffers):
            self.layers[header.key, layer_idx] += 1
            return real_decode(header, layer_idx, buffers)

        monkeypatch.setattr(codec, "parse_header", parse_header)
        monkeypatch.setattr(codec, "decode_layer_encoded", decode_layer_encoded)

    def assert_once(self, keys) -> None:
        assert self.parses == Counter({key: 1 for key in keys})
        assert self.layers == Counter({(key, layer): 1 for key in keys for layer in range(NUM_LAYERS)})


class RoundTrips:
    """Wraps the Redis tier's client: one count per command sent alone or per pipeline executed."""

    def __init__(self, client):
        self._client, self.count = client, 0

    def pipeline(self, *args, **kwargs):
        pipe = self._client.pipeline(*args, **kwargs)
        execute = pipe.execute

        def counted(*a, **kw):
            self.count += 1
            return execute(*a, **kw)

        pipe.execute = counted
        return pipe

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def counted(*a, **kw):
            self.count += 1
            return attr(*a, **kw)

        return counted


def slow_tier_store(engine, tmp_path, tier: Tier, redis_url=None, **kw) -> KVStore:
    """Memory above `tier`; entries written to `tier` only, so every chunk streams from it."""
    kw.setdefault("quantization", KVQuantization.NONE)
    config = StoreConfig(dtype=StorageDtype.FLOAT32, fsync=False, write_tiers=frozenset({tier}),
                         disk_enabled=tier is Tier.DISK, disk_dir=tmp_path / "kv" if tier is Tier.DISK else None,
                         redis_url=redis_url if tier is Tier.REDIS else None, **kw)
    return KVStore(engine.fingerprint, config, shape=engine.kv_shape)


def put_all(store, chunks) -> list[str]:
    keys = [store.key_for(kv.token_ids, kv.context_ids) for kv in chunks]
    for key, kv in zip(keys, chunks):
        store.put(key, kv)
    return keys


class Recording:
    """A layer source that records what it hands the engine (the host tensors, before any cast)."""

    def __init__(self, source):
        self._source, self.layers = source, {}

    def layer(self, layer_idx):
        pairs = self._source.layer(layer_idx)
        self.layers[layer_idx] = [(k.clone(), v.clone()) for k, v in pairs]
        return pairs

    def close(self):
        self._source.close()


def request(engine, store, keys, pipelined, start_layer=1):
    """What the server does for one question: handles, a streamed blend prefill, then promote."""
    handles = [store.handle(k) for k in keys]
    source = Recording(store.layer_source(handles, engine.device, engine.dtype, pipelined=pipelined,
                                          start_layer=start_layer))
    segments = [Segment((1, 5))] + [Segment(h.token_ids, h) for h in handles] + [Segment((7, 8, 9))]
    try:
        result = engine.prefill(segments, mode=PrefillMode.BLEND if start_layer else PrefillMode.REUSE,
                                kv_source=source)
    finally:
        source.close()
    return result, handles, source.layers, store.promote(handles)


def tier_params():
    return [pytest.param(Tier.DISK, id="disk"), pytest.param(Tier.REDIS, id="redis")]


@pytest.fixture
def url_for(request):
    return lambda tier: request.getfixturevalue("redis_url") if tier is Tier.REDIS else None


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("tier", tier_params())
def test_one_header_parse_and_one_read_per_layer_and_the_promoted_entry_is_what_streamed(
        engine, chunks, tmp_path, monkeypatch, url_for, tier, pipelined):
    store = slow_tier_store(engine, tmp_path, tier, url_for(tier))
    keys = put_all(store, chunks)
    counter = ReadCounter(monkeypatch)
    result, handles, streamed, num_promoted = request(engine, store, keys, pipelined)
    assert {h.tier for h in handles} == {tier} and num_promoted == NUM_CHUNKS
    counter.assert_once(keys)  # layers 1.. streamed, layer 0 read by promote: each once
    assert store.stats().tiers[tier.value].bytes_read == sum(h.layer_nbytes * NUM_LAYERS for h in handles)
    memory = store.backend(Tier.MEMORY)
    for i, (key, original) in enumerate(zip(keys, chunks)):
        promoted = memory.get(key)
        for layer, pairs in streamed.items():  # bit for bit what the engine was given
            assert torch.equal(promoted.keys[layer], pairs[i][0]) and torch.equal(promoted.values[layer], pairs[i][1])
        assert torch.equal(promoted.keys, original.keys) and torch.equal(promoted.values, original.values)
    expected = engine.prefill([Segment((1, 5))] + [Segment(c.token_ids, c) for c in chunks] + [Segment((7, 8, 9))],
                              mode=PrefillMode.BLEND)
    assert torch.equal(result.logits, expected.logits)
    assert all(not h.entry.is_open for h in handles)  # released: no file, no kept layers
    store.close()


@pytest.mark.parametrize("pipelined", [False, True])
@pytest.mark.parametrize("start_layer", [0, 1])
def test_redis_streams_one_round_trip_per_layer_for_all_chunks(engine, chunks, tmp_path, redis_url, pipelined,
                                                               start_layer):
    store = slow_tier_store(engine, tmp_path, Tier.REDIS, redis_url)
    keys = put_all(store, chunks)
    backend = store.backend(Tier.REDIS)
    trips = backend._client = RoundTrips(backend._client)
    handles = [store.handle(k) for k in keys]
    assert trips.count == NUM_CHUNKS  # a header each (as before: the server asks for one chunk at a time)
    source = store.layer_source(handles, "cpu", torch.float32, pipelined=pipelined, start_layer=start_layer)
    for layer in range(start_layer, NUM_LAYERS):
        source.layer(layer)
    source.close()
    assert trips.count == NUM_CHUNKS + NUM_LAYERS - start_layer  # one per layer, not one per chunk and layer
    assert store.promote(handles) == NUM_CHUNKS
    assert trips.count == NUM_CHUNKS + NUM_LAYERS - start_layer + (start_layer > 0)  # the layers never streamed: one
    store.close()


@pytest.mark.parametrize("tier", tier_params())
def test_a_chunk_being_prefetched_is_read_once_by_the_prefetch_and_the_request_together(
        engine, chunks, tmp_path, monkeypatch, url_for, tier):
    store = slow_tier_store(engine, tmp_path, tier, url_for(tier))
    keys = put_all(store, chunks)
    counter = ReadCounter(monkeypatch)
    gate = threading.Event()
    store._prefetcher._pool.submit(gate.wait)  # hold the prefetch thread: the request reads first
    assert store.prefetch(keys) == NUM_CHUNKS  # at retrieval: the headers are read here
    result, handles, _, num_promoted = request(engine, store, keys, pipelined=True)
    assert all(h.entry is not None and h.entry.is_shared for h in handles)
    assert num_promoted == 0  # the prefetch copies them up
    gate.set()
    store._prefetcher.wait()
    counter.assert_once(keys)  # the request streamed layers 1..; the prefetch read only layer 0
    memory = store.backend(Tier.MEMORY)
    assert all(torch.equal(memory.get(k).keys, c.keys) for k, c in zip(keys, chunks))
    store.close()


def test_a_finished_prefetch_leaves_nothing_to_read(engine, chunks, tmp_path, monkeypatch):
    store = slow_tier_store(engine, tmp_path, Tier.DISK)
    keys = put_all(store, chunks)
    counter = ReadCounter(monkeypatch)
    store.prefetch(keys)
    store._prefetcher.wait()
    _, handles, _, num_promoted = request(engine, store, keys, pipelined=True)
    assert {h.tier for h in handles} == {Tier.MEMORY} and num_promoted == 0
    counter.assert_once(keys)
    store.close()


def test_layers_are_kept_only_within_the_byte_bound(engine, chunks, tmp_path, monkeypatch):
    """Beyond `max_prefetch_bytes` nothing is kept while streaming: promote reads those layers again."""
    store = slow_tier_store(engine, tmp_path, Tier.DISK, max_prefetch_bytes=1)
    keys = put_all(store, chunks)
    counter = ReadCounter(monkeypatch)
    handles = [store.handle(k) for k in keys]
    source = store.layer_source(handles, "cpu", torch.float32, pipelined=False, start_layer=0)
    for layer in range(NUM_LAYERS):
        source.layer(layer)
    source.close()
    assert all(layer is None for h in handles for layer in h.entry._layers)  # nothing held
    assert store.promote(handles) == NUM_CHUNKS
    assert counter.parses == Counter({key: 1 for key in keys})  # still opened once
    assert set(counter.layers.values()) == {2}
    memory = store.backend(Tier.MEMORY)
    assert all(torch.equal(memory.get(k).values, c.values) for k, c in zip(keys, chunks))
    store.close()


def test_a_chunk_damaged_mid_stream_is_recomputed_not_promoted_from_its_kept_layers(engine, chunks, tmp_path):
    store = slow_tier_store(engine, tmp_path, Tier.DISK)
    keys = put_all(store, chunks)
    handles = [store.handle(k) for k in keys]
    path = store.backend(Tier.DISK).path(keys[1])
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the last layer: found when it streams in
    path.write_bytes(bytes(data))
    source = store.layer_source(handles, "cpu", torch.float32, pipelined=True, start_layer=1,
                                recompute=engine.precompute)
    for layer in range(1, NUM_LAYERS):
        source.layer(layer)
    source.close()
    assert source.stats.num_recovered == 1 and store.stats().tiers["disk"].corrupt == 1
    assert store.promote(handles) == NUM_CHUNKS - 1  # the damaged one was recomputed and put back instead
    assert torch.equal(store.get(keys[1]).keys, chunks[1].keys) and store.backend(Tier.DISK).contains(keys[1])
    store.close()


def test_a_throttled_tier_still_throttles_the_reads_promote_makes(engine, chunks, tmp_path, monkeypatch):
    rate = 2e5  # bytes/s
    store = slow_tier_store(engine, tmp_path, Tier.DISK, throttle_mbps={Tier.DISK: rate / 1e6})
    keys = put_all(store, chunks)
    counter = ReadCounter(monkeypatch)
    handles = [store.handle(k) for k in keys]
    slept = []
    monkeypatch.setattr("kv_store.throttle.time.sleep", slept.append)  # the sleeps it would take
    assert store.promote(handles) == NUM_CHUNKS  # nothing streamed: every layer read here, once
    counter.assert_once(keys)
    assert sum(slept) == pytest.approx(sum(h.layer_nbytes * NUM_LAYERS for h in handles) / rate)
    store.close()
