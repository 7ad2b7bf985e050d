"""Redis tier: the cache shared by several server replicas. Values are the same safetensors blobs
as the disk tier's files, so a layer is one GETRANGE; layer i of several chunks goes out in one pipelined
round trip. Any Redis failure reads as a miss. An entry's TTL is refreshed by its first layer read once
its header is verified (in that read's round trip): a damaged entry is deleted, never kept alive."""

from __future__ import annotations

import logging
import time
from typing import Sequence

import redis
import torch
from redis.backoff import NoBackoff
from redis.retry import Retry

from blend_engine.kv import ChunkKV, KVShape
from kv_store import codec
from kv_store.backend import Backend, ChunkInfo, LayerReader, Tier
from kv_store.codec import EntryHeader
from kv_store.errors import CorruptEntryError, EntryLostError
from kv_store.keys import StorageFormat, is_valid_key

log = logging.getLogger(__name__)
KEY_PREFIX = "ragblend:kv:"
_FIRST_READ_BYTES = 64 << 10  # one round trip fetches the header of any chunk up to ~8k tokens


class RedisReader(LayerReader):
    def __init__(self, backend: RedisBackend, header: EntryHeader):
        self.header, self.info = header, ChunkInfo.from_header(header)
        self._backend = backend
        self.is_ttl_refreshed = False  # set by the first layer read (read_layer_many)

    def read_layer(self, layer_idx: int, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return codec.unpacked(self.read_layer_encoded(layer_idx, pinned))

    def read_layer_encoded(self, layer_idx: int, pinned: bool = False) -> codec.EncodedLayer:
        result = self._backend.read_layer_many([(self, layer_idx)], pinned)[0]
        if isinstance(result, Exception):
            raise result
        return result

    def decode_layer(self, layer_idx: int, chunks: list[bytes], pinned: bool) -> codec.EncodedLayer:
        """Verify and decode a layer from its ranges' bytes (raises EntryLostError if they changed)."""
        buffers = []
        for data, (begin, end) in zip(chunks, self.header.layer_ranges[layer_idx]):
            if len(data) != end - begin:
                raise EntryLostError(f"{self.header.key[:16]} changed or expired mid-read")
            buf = torch.empty(len(data), dtype=torch.uint8, pin_memory=pinned)
            buf.numpy()[:] = memoryview(data)  # one copy, into a writable (optionally pinned) buffer
            buffers.append(buf)
        return codec.decode_layer_encoded(self.header, layer_idx, buffers)


class RedisBackend(Backend):
    tier = Tier.REDIS

    def __init__(self, url: str, ttl_s: int, fingerprint: str, fmt: StorageFormat, shape: KVShape,
                 timeout_s: float = 5.0):
        super().__init__()
        # One retry re-dials a connection dropped by a server restart; no backoff, so a down
        # server costs a refused connect (fast), not seconds of waiting per request.
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=min(timeout_s, 1.0), retry=Retry(NoBackoff(), 1)
        )
        self._ttl_s, self._fingerprint, self._fmt, self._shape = ttl_s, fingerprint, fmt, shape

    def _name(self, key: str) -> str:
        if not is_valid_key(key):
            raise ValueError(f"not a chunk key: {key[:80]!r}")
        return KEY_PREFIX + key

    def _failed(self, what: str, exc: Exception) -> None:
        log.warning("redis %s failed (%s): treated as a miss", what, exc)
        self.counters.add(errors=1, misses=1)

    def read_layer_many(
        self, reads: Sequence[tuple[LayerReader, int]], pinned: bool = False
    ) -> list[codec.EncodedLayer | CorruptEntryError | EntryLostError]:
        """Layers of several entries (of this tier's readers) in one pipelined round trip: a request
        streaming C chunks from Redis costs one round trip per layer, not C."""
        readers = [(_redis_reader(r), layer_idx) for r, layer_idx in reads]
        refreshing: list[RedisReader] = []  # entries read for the first time: in use, kept alive
        has_expire = []  # per read: whether an EXPIRE's reply comes before its ranges'
        start = time.perf_counter()
        try:
            pipe = self._client.pipeline(transaction=False)
            for reader, layer_idx in readers:
                name = self._name(reader.header.key)
                is_first = not reader.is_ttl_refreshed and not any(r is reader for r in refreshing)
                if is_first:
                    pipe.expire(name, self._ttl_s)
                    refreshing.append(reader)
                has_expire.append(is_first)
                for begin, end in reader.header.layer_ranges[layer_idx]:
                    pipe.getrange(name, begin, end - 1)
            replies = iter(pipe.execute())
        except redis.RedisError as exc:
            return [EntryLostError(f"redis unreachable: {exc}") for _ in readers]
        for reader in refreshing:
            reader.is_ttl_refreshed = True
        share_s = (time.perf_counter() - start) / max(len(readers), 1)  # the round trip, shared
        results: list[codec.EncodedLayer | CorruptEntryError | EntryLostError] = []
        for (reader, layer_idx), is_first in zip(readers, has_expire):
            if is_first:
                next(replies)  # EXPIRE's
            chunks = [next(replies) for _ in reader.header.layer_ranges[layer_idx]]
            decode_start = time.perf_counter()
            try:
                results.append(reader.decode_layer(layer_idx, chunks, pinned))
            except (CorruptEntryError, EntryLostError) as exc:
                results.append(exc)
                continue
            seconds = share_s + time.perf_counter() - decode_start
            self.counters.add(bytes_read=reader.header.layer_nbytes(layer_idx), load_seconds=seconds)
        return results

    def put(self, key: str, kv: ChunkKV) -> None:
        blob = codec.encode(kv, key, self._fingerprint, self._fmt)
        try:
            self._client.set(self._name(key), blob, ex=self._ttl_s)
        except redis.RedisError as exc:
            log.warning("redis put failed (%s): entry not shared", exc)
            self.counters.add(errors=1)
            return
        self.counters.add(bytes_written=len(blob))

    def _parse(self, key: str, total: int, head: bytes) -> EntryHeader:
        size = codec.header_size(head, total)
        if size > len(head):
            head += self._client.getrange(self._name(key), len(head), size - 1)
        return codec.parse_header(head[:size], total, key, self._fingerprint, self._fmt, self._shape)

    def open_reader(self, key: str, is_lookup: bool = True) -> RedisReader | None:
        try:
            pipe = self._client.pipeline(transaction=False)
            pipe.strlen(self._name(key)).getrange(self._name(key), 0, _FIRST_READ_BYTES - 1)
            total, head = pipe.execute()  # no EXPIRE yet: the header is unverified (see read_layer_many)
            if total == 0:
                self.counters.add(misses=int(is_lookup))
                return None
            header = self._parse(key, total, head)
        except redis.RedisError as exc:
            self._failed("read", exc)
            return None
        except CorruptEntryError as exc:
            self.discard_corrupt(key, exc)
            return None
        self.counters.add(hits=int(is_lookup))
        return RedisReader(self, header)

    def discard_corrupt(self, key: str, exc: Exception) -> None:
        log.warning("redis KV entry %s is damaged (%s): deleted, will be recomputed", key[:16], str(exc)[:codec.MAX_REASON_CHARS])
        self.delete(key)
        self.counters.add(corrupt=1, misses=1)

    def get(self, key: str) -> ChunkKV | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        """One MGET round trip for all `keys`."""
        start = time.perf_counter()
        try:
            blobs = self._client.mget([self._name(key) for key in keys]) if keys else []
        except redis.RedisError as exc:
            self._failed("get", exc)
            return [None] * len(keys)
        seconds = (time.perf_counter() - start) / max(len(keys), 1)  # the round trip, shared
        return [self._decode(key, blob, seconds) for key, blob in zip(keys, blobs)]

    def _decode(self, key: str, blob: bytes | None, fetch_seconds: float) -> ChunkKV | None:
        if blob is None:
            self.counters.add(misses=1)
            return None
        start = time.perf_counter()
        data = bytearray(blob)  # writable, so tensors can view it without a warning
        try:
            header = codec.read_header(data, key, self._fingerprint, self._fmt, self._shape)
            kv = codec.decode(header, lambda begin, end: memoryview(data)[begin:end])
        except CorruptEntryError as exc:
            self.discard_corrupt(key, exc)
            return None
        seconds = fetch_seconds + time.perf_counter() - start
        self.counters.add(hits=1, bytes_read=len(data), load_seconds=seconds)
        return kv

    def contains(self, key: str) -> bool:
        try:
            return bool(self._client.exists(self._name(key)))
        except redis.RedisError as exc:
            log.warning("redis exists failed (%s)", exc)
            return False

    def readable_many(self, keys: Sequence[str]) -> list[bool]:
        """One pipelined EXISTS round trip (entries are validated when read, not here)."""
        if not keys:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in pipe.execute()]
        except redis.RedisError as exc:
            log.warning("redis exists failed (%s)", exc)
            return [False] * len(keys)

    def delete(self, key: str) -> None:
        try:
            self._client.delete(self._name(key))
        except redis.RedisError as exc:
            log.warning("redis delete failed (%s)", exc)

    def bytes_used(self) -> int:
        """The server's memory in use (Redis bounds itself with maxmemory and the TTL)."""
        try:
            return int(self._client.info("memory").get("used_memory", 0))
        except redis.RedisError:
            return 0

    def close(self) -> None:
        self._client.close()


def _redis_reader(reader: LayerReader) -> RedisReader:
    if not isinstance(reader, RedisReader):
        raise TypeError(f"the Redis tier reads its own readers, not {type(reader).__name__}")
    return reader
