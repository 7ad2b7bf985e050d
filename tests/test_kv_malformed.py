"""Malformed KV entries on the disk and Redis tiers: crafted headers (each kind once answered 500 for
good) and a seeded fuzz of real entries' bytes and header fields. Whatever an entry holds, a read is a
correct read or a healed miss (the entry deleted, counted as corrupt, recomputed by the caller), never
an exception, and what an entry claims is checked against the model before anything is allocated."""

from __future__ import annotations

import json
import random
import struct
import tracemalloc
import zlib
from dataclasses import dataclass
from typing import Callable

import pytest
import redis
import torch

from blend_engine.engine import BlendEngine
from blend_engine.kv import ChunkKV
from configs.enums import KVQuantization
from kv_store import KVStore, StoreConfig, Tier, codec
from kv_store.redis_backend import KEY_PREFIX
from tests.engine_models import build_engine, random_ids

try:
    from tests.redis_server import start_or_skip
except ImportError:  # tests/ is not a package: pytest put it on sys.path itself
    from redis_server import start_or_skip

FORMATS = {"float16": KVQuantization.NONE, "int8": KVQuantization.INT8, "int4": KVQuantization.INT4}
DEPTH = 100_000  # nesting of a crafted header: Python's json module raises RecursionError far below this
MAX_READ_BYTES = 2 << 20  # what one read of this tiny model's entry may allocate (its KV is ~40 KB in fp32)
TTL_S = 3600


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return build_engine("llama-gqa")  # 4 layers, 2 KV heads, head dim 16


@pytest.fixture(scope="module")
def chunk(engine) -> ChunkKV:
    return engine.precompute(random_ids(40, seed=3), (1,))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = start_or_skip(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@dataclass
class Slot:
    """A store of one tier, and the chunk's entry in it written raw (as a crafted or damaged entry is)."""

    store: KVStore
    tier: Tier
    key: str
    write: Callable[[bytes], None]
    holds: Callable[[], bool]

    @property
    def corrupt(self) -> int:
        return self.store.stats().tiers[self.tier.value].corrupt

    def real_entry(self, kv: ChunkKV) -> bytes:
        return codec.encode(kv, self.key, self.store.fingerprint, self.store.config.remote_format)


@pytest.fixture
def make_slot(request, engine, chunk, tmp_path):
    """`make_slot(tier, format name)`: a store with only that tier, in that storage format."""
    stores = []

    def make(tier: str, fmt: str) -> Slot:
        if tier == "disk":
            config = StoreConfig(max_memory_bytes=0, disk_dir=tmp_path / f"kv-{len(stores)}", fsync=False,
                                 quantization=FORMATS[fmt])
        else:
            server = request.getfixturevalue("redis_server")
            config = StoreConfig(max_memory_bytes=0, disk_enabled=False, redis_url=server.url, redis_ttl_s=TTL_S,
                                 quantization=FORMATS[fmt])
        store = KVStore(engine.fingerprint, config, shape=engine.kv_shape)
        stores.append(store)
        key = store.key_for(chunk.token_ids, chunk.context_ids)
        if tier == "disk":
            path = store.backend(Tier.DISK).path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            return Slot(store, Tier.DISK, key, path.write_bytes, path.exists)
        client = redis.Redis.from_url(config.redis_url)
        stores.append(client)
        client.flushall()
        name = KEY_PREFIX + key
        return Slot(store, Tier.REDIS, key, lambda blob: client.set(name, blob, ex=TTL_S),
                    lambda: bool(client.exists(name)))

    yield make
    for s in stores:
        s.close()


def with_peak(fn: Callable[[], object]) -> tuple[object, int]:
    """fn's result and the most memory it held at once (Python and numpy allocations)."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# --- headers taken apart and put together again ---------------------------------------------------
@dataclass(frozen=True)
class Raw:
    """JSON text put into a header as is (what json.dumps would refuse to write: 1e999, deep nesting)."""

    text: str


def _dumps(obj: object) -> str:
    raws: list[str] = []

    def walk(x):
        if isinstance(x, Raw):
            raws.append(x.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    text = json.dumps(walk(obj), separators=(",", ":"))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text


def split(blob: bytes) -> tuple[dict, dict, bytes]:
    """A real entry -> its safetensors table (tensors only), our metadata and the data bytes."""
    n = struct.unpack("<Q", blob[:8])[0]
    table = json.loads(blob[8 : 8 + n])
    meta = json.loads(table.pop("__metadata__")[codec.META_KEY])
    return table, meta, blob[8 + n :]


def join(table: dict, meta: dict | Raw, data: bytes) -> bytes:
    head = _dumps({"__metadata__": {codec.META_KEY: _dumps(meta)}, **table}).encode()
    return struct.pack("<Q", len(head)) + head + data


def nested() -> Raw:
    return Raw("[" * DEPTH + "]" * DEPTH)


# --- crafted entries: each kind found in the field ------------------------------------------------
def deep_nesting_in_metadata(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    return join(table, {**meta, "shape": nested()}, data)


def deep_nesting_in_table(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    return join({**table, "kv.0": nested()}, meta, data)


def overflowing_shape(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    return join(table, {**meta, "shape": Raw(f"[1e999,{kv.keys.shape[1]},{kv.keys.shape[3]}]")}, data)


def huge_shape(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    return join(table, {**meta, "shape": [2**70, *meta["shape"][1:]]}, data)


def non_numeric_shape(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    return join(table, {**meta, "shape": [str(d) for d in meta["shape"]]}, data)


def fractional_shape(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    return join(table, {**meta, "shape": [meta["shape"][0] + 0.5, *meta["shape"][1:]]}, data)


def missing_fingerprint(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    del meta["fingerprint"]
    return join(table, meta, data)


def missing_data_offsets(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    del table["kv.0"]["data_offsets"]
    return join(table, meta, data)


def tensor_as_list(slot: Slot, kv: ChunkKV) -> bytes:
    table, meta, data = split(slot.real_entry(kv))
    table["kv.0"] = list(table["kv.0"].values())
    return join(table, meta, data)


def another_tensor_dtype(slot: Slot, kv: ChunkKV) -> bytes:
    """A tensor's dtype swapped for another of its item size (the bytes would be read as the wrong type)."""
    table, meta, data = split(slot.real_entry(kv))
    table["kv.0"]["dtype"] = {"F16": "BF16", "U8": "I8", "I8": "U8"}[table["kv.0"]["dtype"]]
    return join(table, meta, data)


def token_list_one_short(slot: Slot, kv: ChunkKV) -> bytes:
    """A whole, consistent entry of the chunk's KV but its last token, under the chunk's key."""
    short = ChunkKV(kv.token_ids[:-1], kv.context_ids, kv.keys[:, :, :-1], kv.values[:, :, :-1])
    return slot.real_entry(short)


def another_context(slot: Slot, kv: ChunkKV) -> bytes:
    return slot.real_entry(ChunkKV(kv.token_ids, (2,), kv.keys, kv.values))


def one_layer(slot: Slot, kv: ChunkKV) -> bytes:
    return slot.real_entry(ChunkKV(kv.token_ids, kv.context_ids, kv.keys[:1], kv.values[:1]))


def double_head_dim(slot: Slot, kv: ChunkKV) -> bytes:
    keys, values = kv.keys.repeat(1, 1, 1, 2), kv.values.repeat(1, 1, 1, 2)  # [L, H, n, 2D]
    return slot.real_entry(ChunkKV(kv.token_ids, kv.context_ids, keys, values))


def kv_heads_3000(slot: Slot, kv: ChunkKV) -> bytes:
    """The field's case: a few KB of int4 (constant KV compresses to nothing) claiming 3000 KV heads."""
    zeros = torch.zeros(kv.num_layers, 3000, kv.num_tokens, kv.keys.shape[3])
    return slot.real_entry(ChunkKV(kv.token_ids, kv.context_ids, zeros, zeros))


CRAFTED = [deep_nesting_in_metadata, deep_nesting_in_table, overflowing_shape, huge_shape, non_numeric_shape,
           fractional_shape, missing_fingerprint, missing_data_offsets, tensor_as_list, another_tensor_dtype,
           token_list_one_short, another_context, one_layer, double_head_dim, kv_heads_3000]


def read_handle(slot: Slot):
    return slot.store.handle(slot.key)


def read_whole(slot: Slot):
    return slot.store.get(slot.key)


@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.parametrize("fmt", ["float16", "int4"])
@pytest.mark.parametrize("craft", CRAFTED, ids=lambda f: f.__name__)
def test_a_crafted_entry_is_a_healed_miss_that_allocates_nothing(make_slot, chunk, craft, fmt, tier):
    if craft is kv_heads_3000 and fmt != "int4":
        pytest.skip("3000 heads of float16 is a large entry; the small one that claims them is int4")
    slot = make_slot(tier, fmt)
    blob = craft(slot, chunk)
    if craft is kv_heads_3000:
        assert len(blob) < 16 << 10  # a small entry claiming what would decode to 15 MB a layer
    for read in (read_handle, read_whole):  # a question's handle; a whole read (promotion, `get`)
        slot.write(blob)
        before = slot.corrupt
        found, peak = with_peak(lambda: read(slot))
        assert found is None, f"{craft.__name__} was read by {read.__name__}"
        assert not slot.holds(), "the entry must be deleted, never kept alive"
        assert slot.corrupt == before + 1
        assert peak < MAX_READ_BYTES, f"{read.__name__} held {peak} bytes"
    slot.store.put(slot.key, chunk)  # the caller recomputes: the store is healed
    healed = slot.store.get(slot.key)
    assert healed is not None and healed.token_ids == chunk.token_ids and slot.holds()


def test_a_disk_entry_whose_header_claims_more_than_the_file_is_refused_unread(make_slot, chunk):
    slot = make_slot("disk", "int4")
    slot.write(struct.pack("<Q", (64 << 20) - 1) + b"{}")  # a 10-byte file claiming a 64 MB header
    found, peak = with_peak(lambda: slot.store.handle(slot.key))
    assert found is None and not slot.holds() and slot.corrupt == 1 and peak < 1 << 20


def test_a_redis_entry_ttl_is_refreshed_by_its_first_read_and_never_for_a_damaged_one(make_slot, chunk):
    slot = make_slot("redis", "int4")
    client = redis.Redis.from_url(slot.store.config.redis_url)
    name = KEY_PREFIX + slot.key
    slot.store.put(slot.key, chunk)
    client.expire(name, 100)
    handle = slot.store.handle(slot.key)
    assert 0 < client.ttl(name) <= 100  # the header alone is not yet known sound: no refresh
    handle.entry.read_layer(0)
    assert 100 < client.ttl(name) <= TTL_S  # refreshed in the first layer read's round trip
    handle.entry.release()
    slot.write(one_layer(slot, chunk))  # crafted: deleted at its handle, not refreshed
    assert slot.store.handle(slot.key) is None and client.ttl(name) == -2
    client.close()


def test_a_store_refuses_a_chunk_of_another_shape(make_slot, chunk):
    slot = make_slot("disk", "float16")
    wide = ChunkKV(chunk.token_ids, chunk.context_ids, chunk.keys.repeat(1, 2, 1, 1), chunk.values.repeat(1, 2, 1, 1))
    with pytest.raises(ValueError, match="KV shape"):
        slot.store.put(slot.key, wide)
    assert not slot.holds()


# --- the fuzz ---------------------------------------------------------------------------------------
NUM_CASES = 100  # per format and tier: 600 reads, a few seconds
POOL = [None, True, False, 0, -1, 1, 2, 3, 2**31, 2**32, 2**63, 2**64, 10**30, 1.5, Raw("1e999"), Raw("-1e999"),
        "x", "", "float16", "int4", [], [0], [1, 2], [-1, 3], {}, {"a": 1}, Raw("[" * 300 + "]" * 300)]


@dataclass(frozen=True)
class Case:
    blob: bytes
    what: str
    is_forged: bool = False  # checksums recomputed over changed bytes: the values may differ, nothing else


def _mutate_bytes(rng: random.Random, blob: bytes) -> Case:
    data = bytearray(blob)
    header_end = 8 + struct.unpack("<Q", blob[:8])[0]
    how = rng.choice(["flip", "flip-header", "truncate", "extend", "cut", "length"])
    if how in ("flip", "flip-header"):
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(header_end if how == "flip-header" else len(data))
            data[pos] ^= rng.randint(1, 255)
    elif how == "truncate":
        del data[rng.randrange(len(data)):]
    elif how == "extend":
        data += rng.randbytes(rng.randint(1, 64))
    elif how == "cut":
        begin = rng.randrange(len(data))
        del data[begin : begin + rng.randint(1, 64)]
    else:
        n = rng.choice([0, header_end - 9, header_end - 7, 2**63, rng.randrange(1 << 40)])
        data[:8] = struct.pack("<Q", n)
    return Case(bytes(data), f"bytes: {how}")


def _mutate_value(rng: random.Random, value: object) -> object:
    """Another value for a header field: from the pool, or (a list) one element changed, one more, one less."""
    if isinstance(value, list) and value and rng.random() < 0.5:
        value = list(value)
        how = rng.choice(["element", "drop", "add"])
        if how == "drop":
            value.pop(rng.randrange(len(value)))
        elif how == "add":
            value.insert(rng.randrange(len(value) + 1), rng.choice([0, 1, 7, 2**31]))
        else:
            i = rng.randrange(len(value))
            value[i] = value[i] + rng.choice([-1, 1]) if isinstance(value[i], int) else rng.choice(POOL)
        return value
    return rng.choice(POOL)


def _mutate_fields(rng: random.Random, blob: bytes) -> Case:
    table, meta, data = split(blob)
    if rng.random() < 0.5:  # our metadata
        field = rng.choice([*meta, "unknown"])
        if field in meta and rng.random() < 0.25:
            del meta[field]
            return Case(join(table, meta, data), f"metadata: no {field}")
        meta[field] = _mutate_value(rng, meta.get(field))
        return Case(join(table, meta, data), f"metadata: {field}")
    name = rng.choice([*table, "kv.99"])
    if name not in table or rng.random() < 0.3:  # a whole tensor: gone, added or replaced
        if name in table and rng.random() < 0.5:
            del table[name]
        else:
            table[name] = rng.choice(POOL)
        return Case(join(table, meta, data), f"table: tensor {name}")
    attr = rng.choice(["dtype", "shape", "data_offsets", "extra"])
    if attr in table[name] and rng.random() < 0.25:
        del table[name][attr]
    else:
        table[name][attr] = _mutate_value(rng, table[name].get(attr))
    return Case(join(table, meta, data), f"table: {name}.{attr}")


def _forge(rng: random.Random, blob: bytes) -> Case:
    """Bytes of one layer changed and its checksum made to match: a crafted payload the decoder must survive."""
    table, meta, data = split(blob)
    data = bytearray(data)
    layer = rng.randrange(len(meta["checksums"]))
    ranges = [table[name]["data_offsets"] for name in (f"kv.{layer}", f"scale.{layer}") if name in table]
    begin, end = rng.choice(ranges)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(begin, end)] = rng.randrange(256)
    crc = 0
    for b, e in ranges:
        crc = zlib.crc32(data[b:e], crc)
    meta["checksums"][layer] = crc
    return Case(join(table, meta, bytes(data)), f"forged layer {layer}", is_forged=True)


def _cases(rng: random.Random, blob: bytes) -> list[Case]:
    makers = [_mutate_bytes] * 4 + [_mutate_fields] * 5 + [_forge]
    return [rng.choice(makers)(rng, blob) for _ in range(NUM_CASES)]


def _stream(slot: Slot, handle, kv: ChunkKV) -> tuple[list, int]:
    """Every layer of `handle` as a prefill streams it (recomputed as `kv` if found damaged mid-read)."""
    source = slot.store.layer_source([handle], "cpu", torch.float32, pipelined=False,
                                     recompute=lambda token_ids, context_ids: kv)
    try:
        return [source.layer(i)[0] for i in range(kv.num_layers)], source.stats.num_recovered
    finally:
        source.close()
        if handle.entry is not None:
            handle.entry.release()


def _same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # a forged int4 payload's scales overflow: garbage values
@pytest.mark.parametrize("tier", ["disk", "redis"])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_fuzzed_entries_read_correctly_or_heal(make_slot, chunk, fmt, tier):
    """Mutated real entries (bytes, header fields, forged payloads), read as a question streams them and
    whole: each read is the entry's own content or a healed miss, within a small memory bound."""
    slot = make_slot(tier, fmt)
    real = slot.real_entry(chunk)
    slot.write(real)
    whole = slot.store.get(slot.key)  # the reference reads of the unmutated entry
    streamed, _ = _stream(slot, slot.store.handle(slot.key), chunk)
    recomputed = [(chunk.keys[i], chunk.values[i]) for i in range(chunk.num_layers)]
    rng = random.Random(f"{fmt}-{tier}")
    outcomes = {"read": 0, "healed": 0}
    for i, case in enumerate(_cases(rng, real)):
        slot.write(case.blob)
        before = slot.corrupt
        where = f"case {i} ({case.what})"
        if i % 2:  # whole: `get`
            found, peak = with_peak(lambda: slot.store.get(slot.key))
            if found is None:
                assert not slot.holds() and slot.corrupt == before + 1, where
            elif case.is_forged:
                assert slot.corrupt == before and found.token_ids == whole.token_ids, where
                assert found.keys.shape == whole.keys.shape, where
            else:
                assert slot.corrupt == before, where
                assert found.token_ids == whole.token_ids and found.context_ids == whole.context_ids, where
                assert torch.equal(found.keys, whole.keys) and torch.equal(found.values, whole.values), where
        else:  # streamed: `handle`, then the layers, recomputed where the entry fails mid-read
            (found, layers, num_recovered), peak = with_peak(lambda: _handle_and_stream(slot, chunk))
            if found is None:
                assert not slot.holds() and slot.corrupt == before + 1, where
            elif num_recovered:
                assert slot.corrupt == before + 1, where  # deleted, recomputed and put back
                assert torch.equal(slot.store.get(slot.key).keys, whole.keys), where
            else:
                assert slot.corrupt == before, where
            for got, ref, fresh in zip(layers or [], streamed, recomputed):  # the entry's layer, or recomputed
                assert got[0].shape == ref[0].shape and got[1].shape == ref[1].shape, where
                assert case.is_forged or _same(got, ref) or _same(got, fresh), where
        assert peak < MAX_READ_BYTES, f"{where}: {peak} bytes"
        outcomes["healed" if slot.corrupt > before else "read"] += 1
    assert outcomes["healed"] > NUM_CASES // 2 and outcomes["read"] > 0, outcomes  # both outcomes exercised


def _handle_and_stream(slot: Slot, kv: ChunkKV):
    handle = slot.store.handle(slot.key)
    if handle is None:
        return None, None, 0
    layers, num_recovered = _stream(slot, handle, kv)
    return handle, layers, num_recovered
