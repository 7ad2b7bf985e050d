"""Content-addressed chunk keys: a hash of the chunk's tokens, the prefix it was computed behind,
the model fingerprint and the storage format, so two models or two formats never share an entry; and
the salt of the collection the chunk belongs to, so two collections never share an entry either (unless
both opt into sharing, with one common salt): a question can then never tell by its speed whether
another collection holds a text (as vLLM's per-request `cache_salt`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from configs.enums import KVQuantization, StorageDtype

# Bump when the on-disk/Redis layout changes: old entries then simply stop matching (misses).
FORMAT_VERSION = 1


@dataclass(frozen=True)
class StorageFormat:
    """How an entry's tensors are laid out; part of every key."""

    dtype: StorageDtype = StorageDtype.FLOAT16
    quantization: KVQuantization = KVQuantization.NONE
    version: int = FORMAT_VERSION

    @property
    def tag(self) -> str:
        return f"v{self.version}-{self.dtype.value}-{self.quantization.value}"


def _ids_bytes(ids: Sequence[int]) -> bytes:
    # Length-prefixed so (a, b|c) and (a|b, c) can never hash alike.
    array = np.asarray(ids, dtype=np.int64)
    return np.int64(array.size).tobytes() + array.tobytes()


@dataclass(frozen=True)
class KVScope:
    """Whose KV an entry is: its collection's salt (part of the key), the collection it is accounted to
    (`owner`, for the collection's share of the KV budget) and that collection's own budget. The default
    is what a store without collections had: unsalted, unowned, the store's budget only."""

    salt: str = ""
    owner: str | None = None
    budget_bytes: int | None = None


def chunk_key(fingerprint: str, fmt: StorageFormat, token_ids: Sequence[int], context_ids: Sequence[int],
              salt: str = "") -> str:
    """Hex sha256 over fingerprint, storage format, salt, context ids and token ids. An empty salt hashes
    as before salts existed (the default collection's entries keep their keys)."""
    if not fingerprint:
        raise ValueError("a model fingerprint is required to key chunk caches")
    digest = hashlib.sha256()
    parts = (b"ragblend-kv", fingerprint.encode(), fmt.tag.encode()) + ((b"salt:" + salt.encode(),) if salt else ())
    for part in parts:
        digest.update(np.int64(len(part)).tobytes() + part)
    digest.update(_ids_bytes(context_ids))
    digest.update(_ids_bytes(token_ids))
    return digest.hexdigest()


def is_valid_key(key: str) -> bool:
    """Keys become file names and Redis keys: only our own 64-hex-digit form is accepted."""
    return len(key) == 64 and all(c in "0123456789abcdef" for c in key)
