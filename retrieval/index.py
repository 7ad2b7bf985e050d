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
from typing import Iterable, Sequence

import faiss
import numpy as np

from configs.enums import IndexKind
from retrieval.config import RetrievalConfig

log = logging.getLogger(__name__)

# The index's defaults are the retrieval config's (one place): a caller that passes none gets those.
_DEFAULTS = RetrievalConfig()


@dataclass(frozen=True)
class Hit:
    row_id: int
    score: float


class VectorIndex:
    def __init__(self, dim: int, kind: IndexKind = _DEFAULTS.index, hnsw_m: int = _DEFAULTS.hnsw_m,
                 path: Path | None = None):
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
    def load_or_create(cls, path: Path, dim: int, kind: IndexKind, hnsw_m: int = _DEFAULTS.hnsw_m) -> VectorIndex:
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


# Written into the index directory once its files are named by `index_file_stem`: a directory without it
# holds files named before (the collection's name as it is), which are deleted and rebuilt from the store.
LAYOUT_MARKER = "layout"
LAYOUT = "file names: each capital letter as '~' and its lower case\n"


def index_file_stem(collection: str) -> str:
    """A collection's index file name (without `.faiss`). Names differing only by case ('TEAM-A',
    'team-a') are two collections, but one file on a case-insensitive filesystem (macOS's, Windows'):
    each capital letter is written as '~' and its lower case ('~t~e~a~m-~a'), so every file name is in
    lower case and, '~' being in no collection name, no two collections share one. A name in lower case
    is its own file name."""
    return "".join(f"~{c.lower()}" if "A" <= c <= "Z" else c for c in collection)


def collection_of_stem(stem: str) -> str | None:
    """The collection `index_file_stem` named `stem` for; None when it names none (a capital letter, a
    '~' not before a lower-case letter): not a file this layout writes."""
    parts, rest = [], iter(stem)
    for c in rest:
        if "A" <= c <= "Z":
            return None
        if c == "~":
            letter = next(rest, "")
            if not "a" <= letter <= "z":
                return None
            c = letter.upper()
        parts.append(c)
    return "".join(parts)


class CollectionIndexes:
    """One VectorIndex per collection (`<directory>/<index_file_stem(collection)>.faiss`): a question
    searches only its collections' indexes, so its cost, and its timing, depend on those collections
    alone, never on what the others hold. Chosen over one index searched with an id filter by measurement
    (docs/decisions/0019: at 200 collections x 500 chunks a filtered search walks all 100 000 vectors,
    ~8x the collection's own at the median; at 1 x 100 000 the two are alike). Chunk row ids are unique
    across collections, so a row id names one index's vector."""

    def __init__(self, directory: Path | None, dim: int, kind: IndexKind = _DEFAULTS.index,
                 hnsw_m: int = _DEFAULTS.hnsw_m, search_threads: int = _DEFAULTS.search_threads):
        self.directory, self.dim, self.kind, self.hnsw_m = directory, dim, kind, hnsw_m
        self.search_threads = search_threads
        self._lock = threading.Lock()  # guards the two maps; each VectorIndex has its own lock
        self._shards: dict[str, VectorIndex] = {}
        self._owner: dict[int, str] = {}  # row id -> collection
        self._dropped: set[str] = set()  # emptied shards whose files go at the next save

    def _path(self, collection: str) -> Path | None:
        return None if self.directory is None else self.directory / f"{index_file_stem(collection)}.faiss"

    def _shard(self, collection: str) -> VectorIndex:
        with self._lock:
            shard = self._shards.get(collection)
            if shard is None:
                shard = self._shards[collection] = VectorIndex(self.dim, self.kind, self.hnsw_m, self._path(collection))
                self._dropped.discard(collection)
            return shard

    @property
    def num_vectors(self) -> int:
        with self._lock:
            return sum(shard.num_vectors for shard in self._shards.values())

    @property
    def collections(self) -> list[str]:
        with self._lock:
            return sorted(self._shards)

    @property
    def loaded_kind(self) -> IndexKind:
        """The configured kind, unless a loaded shard is of another (a file made before a config change)."""
        with self._lock:
            kinds = {shard.loaded_kind for shard in self._shards.values()}
        return next(iter(kinds - {self.kind}), self.kind)

    @property
    def supports_remove(self) -> bool:
        return self.kind is IndexKind.FLAT

    def ids(self) -> np.ndarray:
        """Every id every shard holds [n] int64 (duplicates kept: reconcile looks for them)."""
        with self._lock:
            shards = list(self._shards.values())
        parts = [shard.ids() for shard in shards]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def add(self, row_ids: Sequence[int] | np.ndarray, vectors: np.ndarray, collections: Sequence[str]) -> None:
        """Add each vector to its collection's index (`collections[i]`: row i's)."""
        row_ids = np.asarray(row_ids, dtype=np.int64)
        if len(collections) != len(row_ids):
            raise ValueError(f"{len(row_ids)} row ids but {len(collections)} collections")
        names = np.asarray(collections, dtype=object)
        for collection in dict.fromkeys(collections):
            mask = names == collection
            self._shard(collection).add(row_ids[mask], np.asarray(vectors)[mask])
            with self._lock:
                self._owner.update((int(i), collection) for i in row_ids[mask])

    def remove(self, row_ids: Iterable[int]) -> int:
        """Drop these ids from whichever index holds them; ids no index holds are skipped."""
        by_collection: dict[str, list[int]] = {}
        with self._lock:
            for row_id in row_ids:
                collection = self._owner.pop(int(row_id), None)
                if collection is not None:
                    by_collection.setdefault(collection, []).append(int(row_id))
        return sum(self._shard(c).remove(ids) for c, ids in by_collection.items())

    def rebuild(self, batches: Iterable[tuple[np.ndarray, np.ndarray, Sequence[str]]],
                collections: Sequence[str] | None = None) -> None:
        """Rebuild from (row ids, vectors, collections) batches: every shard, or only `collections`' (the
        batches may hold others' rows: skipped)."""
        wanted = None if collections is None else set(collections)
        grouped: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for row_ids, vectors, names in batches:
            names_array = np.asarray(names, dtype=object)
            for collection in dict.fromkeys(names):
                if wanted is not None and collection not in wanted:
                    continue
                mask = names_array == collection
                grouped.setdefault(collection, []).append((np.asarray(row_ids)[mask], np.asarray(vectors)[mask]))
        rebuilt: dict[str, VectorIndex] = {}
        for collection, parts in grouped.items():
            shard = VectorIndex(self.dim, self.kind, self.hnsw_m, self._path(collection))
            shard.rebuild(parts)
            rebuilt[collection] = shard
        with self._lock:
            targets = set(self._shards) if wanted is None else wanted & set(self._shards) | set(rebuilt)
            self._owner = {} if wanted is None else {i: c for i, c in self._owner.items() if c not in targets}
            for collection in targets:
                if collection not in rebuilt and collection in self._shards:
                    del self._shards[collection]
                    self._dropped.add(collection)
            for collection, shard in rebuilt.items():
                self._shards[collection] = shard
                self._dropped.discard(collection)
                self._owner.update((int(i), collection) for i in shard.ids())

    def search(self, query: np.ndarray, top_k: int, collections: Sequence[str]) -> list[Hit]:
        """The best `top_k` hits over these collections' indexes, best first (each index's own best
        `top_k`, merged by score: exact for flat indexes)."""
        with self._lock:
            shards = [self._shards[c] for c in dict.fromkeys(collections) if c in self._shards]
        # FAISS's OpenMP (its own libgomp, not torch's) on `search_threads` threads for this search: its
        # threads otherwise wake beside torch's, still spinning after the question's embedding, and a
        # 1-vector search of 10 000 waited ~10 ms at p99 on 2 cores (0.8 ms on one: docs/benchmarks/
        # retrieval.md). The setting is the calling thread's own; it is put back after.
        threads = faiss.omp_get_max_threads()
        faiss.omp_set_num_threads(self.search_threads)
        try:
            hits = [hit for shard in shards for hit in shard.search(query, top_k)]
        finally:
            faiss.omp_set_num_threads(threads)
        return sorted(hits, key=lambda h: -h.score)[:top_k]

    def save(self) -> None:
        """Save every non-empty shard (atomically, each); delete the files of emptied or dropped ones."""
        if self.directory is None:
            return
        with self._lock:
            shards = dict(self._shards)
            for collection, shard in shards.items():
                if shard.num_vectors == 0:
                    del self._shards[collection]
                    self._dropped.add(collection)
            dropped, self._dropped = set(self._dropped), set()
        self._mark_layout()
        for collection, shard in shards.items():
            if shard.num_vectors > 0:
                shard.save()
        for collection in dropped - {c for c, s in shards.items() if s.num_vectors > 0}:
            path = self._path(collection)
            if path is not None:
                path.unlink(missing_ok=True)

    @classmethod
    def load_or_create(cls, directory: Path, dim: int, kind: IndexKind, hnsw_m: int = _DEFAULTS.hnsw_m,
                       legacy_path: Path | None = None,
                       search_threads: int = _DEFAULTS.search_threads) -> CollectionIndexes:
        """The saved shards under `directory` (an unreadable one starts empty: the caller reconciles it
        with the store). `legacy_path`: the single index of a data directory made before collections,
        which held only the default collection's chunks: loaded as its shard, saved there, then removed."""
        indexes = cls(directory, dim, kind, hnsw_m, search_threads)
        files = sorted(directory.glob("*.faiss")) if directory.is_dir() else []
        marker = directory / LAYOUT_MARKER
        if files and not marker.is_file():
            # Named before index_file_stem: on a case-insensitive filesystem two collections differing by
            # case may have shared a file (its vectors the last writer's), which no file name tells.
            # Deleted: the caller's reconcile adds every chunk again, from the store's embeddings.
            log.warning("vector indexes under %s were named by the collection's name as it is: rebuilt from the "
                        "store under case-safe names", directory)
            for path in files:
                path.unlink()
            files = []
        indexes._mark_layout()
        for path in files:
            collection = collection_of_stem(path.stem)
            if collection is None:  # no collection's file: its chunks, if any, are added to theirs by reconcile
                log.warning("index %s names no collection: deleted", path)
                path.unlink()
                continue
            indexes._adopt(collection, VectorIndex.load_or_create(path, dim, kind, hnsw_m))
        if legacy_path is not None and legacy_path.is_file():
            from retrieval.store_types import DEFAULT_COLLECTION  # the one collection before collections

            if DEFAULT_COLLECTION not in indexes._shards:
                shard = VectorIndex.load_or_create(legacy_path, dim, kind, hnsw_m)
                shard.path = indexes._path(DEFAULT_COLLECTION)
                indexes._adopt(DEFAULT_COLLECTION, shard)
                indexes.save()
            legacy_path.unlink()
        return indexes

    def _mark_layout(self) -> None:
        """Say that this directory's files are named by `index_file_stem` (before any is written)."""
        if self.directory is None:
            return
        marker = self.directory / LAYOUT_MARKER
        if not marker.is_file():
            self.directory.mkdir(parents=True, exist_ok=True)
            marker.write_text(LAYOUT)

    def _adopt(self, collection: str, shard: VectorIndex) -> None:
        try:
            ids = shard.ids()
        except TypeError:  # no id map: an index this code never writes; start empty, reconcile rebuilds
            log.warning("index %s has no id map: starting it empty, rebuilt from the store", shard.path)
            shard = VectorIndex(self.dim, self.kind, self.hnsw_m, shard.path)
            ids = np.zeros(0, dtype=np.int64)
        self._shards[collection] = shard
        self._owner.update((int(i), collection) for i in ids)
