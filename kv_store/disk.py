"""Disk tier: one safetensors file per chunk, the directory is the index.

Files are written to a temp name and renamed into place (atomic: a reader sees the old file,
the new one or none, never a partial one; two writers of one key leave one valid file). Readers
fetch one layer at a time with pread. Last use is the file's mtime, so LRU order survives restarts.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import torch

from blend_engine.kv import ChunkKV, KVShape
from kv_store import codec
from kv_store.backend import Backend, ChunkInfo, LayerReader, Tier
from kv_store.codec import EntryHeader
from kv_store.errors import CorruptEntryError
from kv_store.keys import StorageFormat, is_valid_key

log = logging.getLogger(__name__)
SUFFIX = ".kv.safetensors"
_STALE_TEMP_S = 600.0  # temp files older than this were left by a crashed writer


class DiskReader(LayerReader):
    def __init__(self, backend: DiskBackend, fd: int, header: EntryHeader):
        self.header, self.info = header, ChunkInfo.from_header(header)
        self._backend, self._fd = backend, fd

    def read_layer(self, layer_idx: int, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return codec.unpacked(self.read_layer_encoded(layer_idx, pinned))

    def read_layer_encoded(self, layer_idx: int, pinned: bool = False) -> codec.EncodedLayer:
        start = time.perf_counter()
        buffers = [self._pread(begin, end, pinned) for begin, end in self.header.layer_ranges[layer_idx]]
        layer = codec.decode_layer_encoded(self.header, layer_idx, buffers)
        self._backend.counters.add(bytes_read=self.header.layer_nbytes(layer_idx), load_seconds=time.perf_counter() - start)
        return layer

    def _pread(self, begin: int, end: int, pinned: bool):
        # Read straight into the destination buffer (pinned for an async host-to-device copy).
        buf = torch.empty(end - begin, dtype=torch.uint8, pin_memory=True) if pinned else bytearray(end - begin)
        num_read = os.preadv(self._fd, [buf.numpy() if pinned else buf], begin)
        if num_read != end - begin:
            raise CorruptEntryError(f"{self.header.key[:16]}: short read {num_read} of {end - begin}")
        return buf

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class DiskBackend(Backend):
    tier = Tier.DISK

    def __init__(self, root: Path, max_bytes: int, fingerprint: str, fmt: StorageFormat, shape: KVShape,
                 fsync: bool = True):
        super().__init__()
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.root, self.max_bytes = Path(root), max_bytes
        self._fingerprint, self._fmt, self._shape, self._fsync = fingerprint, fmt, shape, fsync
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, least recently used first
        self._num_bytes = 0
        (self.root / "tmp").mkdir(parents=True, exist_ok=True)
        self._scan()

    def path(self, key: str) -> Path:
        if not is_valid_key(key):
            raise ValueError(f"not a chunk key: {key[:80]!r}")
        return self.root / key[:2] / (key + SUFFIX)

    def _scan(self) -> None:
        """Rebuild the LRU index from the directory (oldest mtime first); drop stale temp files."""
        found = []
        for path in self.root.glob("??/*" + SUFFIX):
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            found.append((st.st_mtime, path.name[: -len(SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._sizes[key] = size
            self._num_bytes += size
        now = time.time()
        for tmp in (self.root / "tmp").iterdir():
            try:
                if now - tmp.stat().st_mtime > _STALE_TEMP_S or not _is_writer_alive(tmp.name):
                    tmp.unlink()
            except FileNotFoundError:
                pass
        self._evict()

    def _track(self, key: str, size: int | None) -> None:
        """Record a use (size) or a removal (None) of `key` in the LRU index."""
        with self._lock:
            self._num_bytes -= self._sizes.pop(key, 0)
            if size is not None:
                self._sizes[key] = size
                self._num_bytes += size

    def put(self, key: str, kv: ChunkKV) -> None:
        path = self.path(key)
        if path.exists():  # content-addressed: an existing entry already holds these bytes
            self._touch(key, path)
            return
        blob = codec.encode(kv, key, self._fingerprint, self._fmt)
        if len(blob) > self.max_bytes:
            return
        path.parent.mkdir(exist_ok=True)
        tmp = self.root / "tmp" / f"{key}.{os.getpid()}.{uuid.uuid4().hex}.part"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
                if self._fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        self.counters.add(bytes_written=len(blob))
        self._track(key, len(blob))
        self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                if self._num_bytes <= self.max_bytes or not self._sizes:
                    return
                key, size = self._sizes.popitem(last=False)
                self._num_bytes -= size
            self.path(key).unlink(missing_ok=True)
            self.counters.add(evictions=1)

    def _touch(self, key: str, path: Path) -> None:
        try:
            os.utime(path)
            self._track(key, path.stat().st_size)
        except FileNotFoundError:
            self._track(key, None)

    def open_reader(self, key: str, is_lookup: bool = True) -> DiskReader | None:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self._track(key, None)
            self.counters.add(misses=int(is_lookup))
            return None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 8, 0)
            head += os.pread(fd, codec.header_size(head, size) - 8, 8)
            header = codec.parse_header(head, size, key, self._fingerprint, self._fmt, self._shape)
        except CorruptEntryError as exc:
            os.close(fd)
            self.discard_corrupt(key, exc)
            return None
        self._touch(key, path)
        self.counters.add(hits=int(is_lookup))
        return DiskReader(self, fd, header)

    def discard_corrupt(self, key: str, exc: Exception) -> None:
        log.warning("disk KV entry %s is damaged (%s): deleted, will be recomputed", key[:16], str(exc)[:codec.MAX_REASON_CHARS])
        self.delete(key)
        self.counters.add(corrupt=1, misses=1)

    def get(self, key: str) -> ChunkKV | None:
        reader = self.open_reader(key)
        if reader is None:
            return None
        try:
            layers = [reader.read_layer(layer_idx) for layer_idx in range(reader.header.num_layers)]
            keys = torch.stack([k for k, _ in layers])  # [L, H, n, D]
            values = torch.stack([v for _, v in layers])  # [L, H, n, D]
            return ChunkKV(reader.header.token_ids, reader.header.context_ids, keys, values, reader.header.salt)
        except CorruptEntryError as exc:
            self.discard_corrupt(key, exc)
            self.counters.add(hits=-1)
            return None
        finally:
            reader.close()

    def contains(self, key: str) -> bool:
        return self.path(key).exists()

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
        self._track(key, None)

    def bytes_used(self) -> int:
        with self._lock:
            return self._num_bytes

    def keys_lru_order(self) -> list[str]:
        with self._lock:
            return list(self._sizes)

    def victims(self, num_bytes: int) -> list[str]:
        """The least recently used keys whose files add up to `num_bytes`: what a write that size evicts."""
        out, total = [], 0
        with self._lock:
            for key, size in self._sizes.items():
                if total >= num_bytes:
                    break
                out.append(key)
                total += size
        return out

    def sizes_of(self, keys) -> list[int | None]:
        """Each entry's file bytes, or None where the tier does not hold it (from the index: no I/O)."""
        with self._lock:
            return [self._sizes.get(key) for key in keys]


def _is_writer_alive(temp_name: str) -> bool:
    """Whether the process that writes this temp file (`<key>.<pid>.<uuid>.part`) still runs: a
    writer killed mid-write (kill -9) leaves its temp file behind, removed at the next start."""
    parts = temp_name.split(".")
    if len(parts) != 4 or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return True  # another store over this directory in this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True
