"""FAISS vector index over normalised embeddings (inner product = cosine), persisted to disk.

FAISS ids are the document store's chunk row ids, so a hit maps straight to its chunk.
"""

from __future__ import annotations

import logging
import errno
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import faiss
import numpy as np

from configs.enums import IndexKind

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Hit:
    row_id: int
    score: float


class VectorIndex:
    def __init__(self, dim: int, kind: IndexKind = IndexKind.FLAT, hnsw_m: int = 32, path: Path | None = None):
        self.dim, self.kind, self.hnsw_m, self.path = dim, kind, hnsw_m, path
        self._lock = threading.Lock()
        self._index = self._new_index()

    def _new_index(self) -> faiss.Index:
        if self.kind is IndexKind.HNSW:
            base = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            base.hnsw.efSearch = 64
        else:
            base = faiss.IndexFlatIP(self.dim)
        return faiss.IndexIDMap2(base)

    @property
    def num_vectors(self) -> int:
        return int(self._index.ntotal)

    @property
    def loaded_kind(self) -> IndexKind:
        """The kind of the index actually held (a loaded file may predate a config change)."""
        inner = faiss.downcast_index(self._index.index) if hasattr(self._index, "index") else self._index
        return IndexKind.HNSW if isinstance(inner, faiss.IndexHNSW) else IndexKind.FLAT

    def ids(self) -> np.ndarray:
        """Every id the index holds [n] int64 (the chunk row ids), for reconciling with the store."""
        with self._lock:
            id_map = getattr(self._index, "id_map", None)
            if id_map is None:
                raise TypeError("the index holds no id map; rebuild it")
            return faiss.vector_to_array(id_map).astype(np.int64)

    @property
    def supports_remove(self) -> bool:
        return self.kind is IndexKind.FLAT  # HNSW graphs cannot drop nodes: rebuild instead

    def add(self, row_ids: np.ndarray, vectors: np.ndarray) -> None:
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise ValueError(f"expected [n, {self.dim}] vectors, got {vectors.shape}")
        with self._lock:
            self._index.add_with_ids(vectors, np.asarray(row_ids, dtype=np.int64))

    def remove(self, row_ids: Iterable[int]) -> int:
        ids = np.fromiter(row_ids, dtype=np.int64)
        if not self.supports_remove:
            raise NotImplementedError("HNSW index cannot remove vectors; rebuild it")
        with self._lock:
            return int(self._index.remove_ids(ids))

    def rebuild(self, batches: Iterable[tuple[np.ndarray, np.ndarray]]) -> None:
        index = self._new_index()
        for row_ids, vectors in batches:
            index.add_with_ids(np.ascontiguousarray(vectors, dtype=np.float32), row_ids.astype(np.int64))
        with self._lock:
            self._index = index

    def search(self, query: np.ndarray, top_k: int) -> list[Hit]:
        """Best `top_k` hits of one query vector [dim], best first."""
        with self._lock:
            if self._index.ntotal == 0:
                return []
            k = min(top_k, int(self._index.ntotal))
            scores, ids = self._index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), k)
        return [Hit(int(i), float(s)) for s, i in zip(scores[0], ids[0]) if i >= 0]

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        try:
            with self._lock:
                faiss.write_index(self._index, str(tmp))
            os.replace(tmp, self.path)
        except RuntimeError as exc:  # faiss reports a failed write as a RuntimeError naming strerror
            if os.strerror(errno.ENOSPC) in str(exc):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp)) from exc
            raise
        finally:  # a failed write (a full disk) leaves no half-written index.tmp behind
            tmp.unlink(missing_ok=True)

    @classmethod
    def load_or_create(cls, path: Path, dim: int, kind: IndexKind, hnsw_m: int = 32) -> VectorIndex:
        """The saved index, or an empty one when there is none or it cannot be read (the caller then
        rebuilds it from the document store, the source of truth)."""
        index = cls(dim, kind, hnsw_m, path)
        if path.is_file():
            try:
                loaded = faiss.read_index(str(path))
            except RuntimeError as exc:
                log.warning("index %s is unreadable (%s): starting empty, rebuilt from the store", path, exc)
                return index
            if loaded.d != dim:
                raise ValueError(f"index at {path} has dim {loaded.d}, embedder has {dim}; delete it to rebuild")
            index._index = loaded
        return index
