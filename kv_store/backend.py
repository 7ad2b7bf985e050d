"""The abstract tier: get / put / contains / delete, plus batched and per-layer reads."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import torch

from blend_engine.kv import ChunkKV
from kv_store.codec import EncodedLayer, EntryHeader, read_layer_nbytes
from kv_store.errors import CorruptEntryError, EntryLostError
from kv_store.stats import TierCounters
from configs.enums import Tier  # noqa: F401  (defined with the settings' enums; the store's own type)

LayerPair = tuple[torch.Tensor, torch.Tensor]  # keys, values [H, n, D]


@dataclass(frozen=True)
class ChunkInfo:
    """What a tier knows of an entry without reading its tensors."""

    key: str
    token_ids: tuple[int, ...]
    context_ids: tuple[int, ...]
    num_layers: int
    layer_nbytes: int  # stored bytes of one layer (what a per-layer read moves)
    read_layer_nbytes: int | None = None  # host bytes of one layer once read, where not the stored bytes
    salt: str = ""  # the collection's KV salt its key was made with (kv_store/keys.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_read_bytes(self) -> int:
        """Host bytes of the whole entry once read (what keeping every layer read holds)."""
        return (self.read_layer_nbytes or self.layer_nbytes) * self.num_layers

    @classmethod
    def from_header(cls, header: EntryHeader) -> ChunkInfo:
        return cls(header.key, header.token_ids, header.context_ids, header.num_layers, header.layer_nbytes(0),
                   read_layer_nbytes(header), header.salt)

    @classmethod
    def from_kv(cls, key: str, kv: ChunkKV) -> ChunkInfo:
        return cls(key, kv.token_ids, kv.context_ids, kv.num_layers, kv.nbytes // max(kv.num_layers, 1),
                   salt=kv.salt)


class LayerReader(abc.ABC):
    """One stored chunk, open for layer-by-layer reads (a file descriptor, a Redis key, tensors)."""

    info: ChunkInfo

    @abc.abstractmethod
    def read_layer(self, layer_idx: int, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [H, n, D] on CPU (storage dtype); raises CorruptEntryError / KeyError (gone)."""

    def read_layer_encoded(self, layer_idx: int, pinned: bool = False) -> EncodedLayer:
        """The layer as stored, unpacked where it lands (e.g. on the GPU): K and V in one block
        (`StackedLayer`, one copy to move) and an int8 entry's still int8 (`QuantizedLayer`).
        By default, as `read_layer` gives it."""
        return self.read_layer(layer_idx, pinned)

    def close(self) -> None:
        """Release what the reader holds."""


class Backend(abc.ABC):
    """A storage tier. Every method is thread-safe; a damaged entry reads as a miss and is deleted."""

    tier: Tier

    def __init__(self) -> None:
        self.counters = TierCounters()

    @abc.abstractmethod
    def get(self, key: str) -> ChunkKV | None: ...

    @abc.abstractmethod
    def put(self, key: str, kv: ChunkKV) -> None: ...

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def get_many(self, keys: Sequence[str]) -> list[ChunkKV | None]:
        return [self.get(key) for key in keys]

    def readable_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each entry is here and its header is sound (not counted as lookups). A damaged
        entry found here is deleted, like at any read."""
        found = []
        for key in keys:
            reader = self.open_reader(key, is_lookup=False)
            if reader is not None:
                reader.close()
            found.append(reader is not None)
        return found

    def info(self, key: str) -> ChunkInfo | None:
        """The entry's header alone (cheap), or None on a miss. Counts as a lookup (hit or miss)."""
        reader = self.open_reader(key)
        if reader is None:
            return None
        reader.close()
        return reader.info

    @abc.abstractmethod
    def open_reader(self, key: str, is_lookup: bool = True) -> LayerReader | None:
        """A per-layer reader (header validated), or None on a miss.

        `is_lookup=False` when re-opening an entry a handle already found (not counted twice).
        """

    def read_layer_many(
        self, reads: Sequence[tuple[LayerReader, int]], pinned: bool = False
    ) -> list[EncodedLayer | CorruptEntryError | EntryLostError]:
        """`reader.read_layer_encoded(layer_idx)` for each pair of this tier's readers, together where
        the tier can (Redis: one round trip). A failed read comes back as its exception, in place."""
        results: list[EncodedLayer | CorruptEntryError | EntryLostError] = []
        for reader, layer_idx in reads:
            try:
                results.append(reader.read_layer_encoded(layer_idx, pinned))
            except (CorruptEntryError, EntryLostError) as exc:
                results.append(exc)
        return results

    def bytes_used(self) -> int:
        return 0

    def close(self) -> None:
        """Release files, sockets, memory."""
