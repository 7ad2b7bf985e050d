"""Retrieval: the embedder, the FAISS index and the document store kept consistent."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from configs.enums import RetrievalMode
from retrieval.config import RetrievalConfig
from retrieval.doc_store import SqliteDocumentStore
from retrieval.store_types import DocumentStore, StoredChunk
from retrieval.embedder import Embedder
from retrieval.reembed import reembed_if_changed
from retrieval.index import CollectionIndexes
from retrieval.lexical import named_words, query_terms, reciprocal_rank_fusion, word_parts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reconciliation:
    """What start-up changed in the index to match the store (all zero: it already matched)."""

    num_added: int = 0
    num_removed: int = 0
    is_rebuilt: bool = False

    @property
    def is_changed(self) -> bool:
        return bool(self.num_added or self.num_removed or self.is_rebuilt)


@dataclass(frozen=True)
class ScoredChunk:
    chunk: StoredChunk
    score: float | None  # cosine similarity to the question; None when the chunk was named, not retrieved
    rank_score: float | None = None  # what ranked it: the cosine (dense), BM25 / ts_rank_cd (lexical), RRF (hybrid)
    # hybrid: the question's names (`named_words`) this chunk holds as written, of those few chunks hold
    # (`DocumentStore.name_hits`); what moved it up, and what keeps it above the relevance floor's margin
    matched_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class QuestionWords:
    """What of a question the searched collections do not hold (`Retriever.question_words`)."""

    unmentioned_names: tuple[str, ...] = ()  # what it names ("CUPS", "core.autocrlf") with a part in no chunk
    unmatched_words: tuple[str, ...] = ()  # its words (stop words left out) that no chunk holds


@dataclass(frozen=True)
class CheckedSearch:
    """A search's chunks and its question's words the collections do not hold (`Retriever.checked_search`)."""

    scored: list[ScoredChunk]
    words: QuestionWords


@dataclass(frozen=True)
class RelevanceFloor:
    """Which retrieved chunks count as relevant, by their cosine similarity to the question: none when
    the best is below `min_score` (the question is about nothing stored), else those within `margin`
    of the best."""

    min_score: float
    margin: float

    def apply(self, scored: Sequence[ScoredChunk]) -> list[ScoredChunk]:
        """The relevant chunks, in their order. Once the best has reached the minimum, a chunk holding a
        name the question asks about (a configuration entry, an option) is kept whatever its score: its
        text may say little else the question's embedding is close to ("UMASK 022" beside a question about
        the permissions of new files)."""
        scores = [s.score for s in scored if s.score is not None]
        if not scores or max(scores) < self.min_score:
            return []
        floor = max(self.min_score, max(scores) - self.margin)
        return [s for s in scored if s.score is not None and (s.score >= floor or s.matched_names)]


@dataclass(frozen=True)
class CatchUp:
    """What following the shared store's change log did to the index."""

    seq: int
    num_added: int = 0
    num_removed: int = 0
    is_reconciled: bool = False  # the log no longer reached back: reconciled by id sets instead


class Retriever:
    def __init__(self, embedder: Embedder, index: CollectionIndexes, store: DocumentStore):
        self.embedder, self.index, self.store = embedder, index, store
        # follow() (this process's writes) and catch_up() (other replicas') each read then change the
        # index: one at a time, or a chunk could be added twice.
        self._follow_lock = threading.Lock()
        self.seq = 0  # the last change of the store's log the index has followed
        # beside a question's embedding: hybrid's lexical ranking and the question's words looked up (threads
        # start on first use; two a search)
        self._side = ThreadPoolExecutor(max_workers=8, thread_name_prefix="ragblend-retrieval")

    @classmethod
    def open(cls, data_dir: Path, settings: RetrievalConfig, store: DocumentStore | None = None) -> Retriever:
        """Open the store (default: SQLite under `data_dir`) and the collections' indexes under
        `data_dir/index/`; reconcile them with the store by id sets (rebuilt if stale or unreadable). A
        data directory's single `index.faiss` from before collections becomes the default collection's."""
        embedder = Embedder.from_name(settings.embedder, batch_size=settings.embed_batch_size,
                                      runtime=settings.embedder_runtime, cache_dir=settings.embedder_cache_dir)
        store = store if store is not None else SqliteDocumentStore(data_dir / "documents.sqlite3")
        try:
            num_reembedded = reembed_if_changed(store, embedder)
            _drop_stale_indexes(data_dir, embedder.identity, is_stale=num_reembedded > 0)
            index = CollectionIndexes.load_or_create(data_dir / "index", embedder.dim, settings.index, settings.hnsw_m,
                                                     legacy_path=data_dir / "index.faiss",
                                                     search_threads=settings.search_threads)
            retriever = cls(embedder, index, store)
            retriever.seq = store.change_seq()  # before reading the id sets: a later commit is caught up
            retriever.reconcile()
        except BaseException:
            store.close()
            raise
        return retriever

    def reconcile(self) -> Reconciliation:
        """Make the index hold exactly the store's chunks, compared by id sets (not counts).

        The store is the source of truth and every write commits there first; the index follows and
        is saved lazily, so after a crash it may miss new chunks and hold dead ones (row ids are
        never reused, so a dead id can never pass for a live chunk).
        """
        with self._follow_lock:
            return self._reconcile()

    def _reconcile(self) -> Reconciliation:
        stored = self.store.row_ids()
        indexed = self.index.ids()
        has_duplicates = len(np.unique(indexed)) != len(indexed)
        indexed_set = set(indexed.tolist())
        missing, dead = sorted(stored - indexed_set), sorted(indexed_set - stored)
        if not missing and not dead and not has_duplicates and self.index.loaded_kind is self.index.kind:
            return Reconciliation()
        logger.warning("index out of step with the store: %d chunks missing, %d dead ids; reconciling",
                       len(missing), len(dead))
        if has_duplicates or self.index.loaded_kind is not self.index.kind or (dead and not self.index.supports_remove):
            self.index.rebuild(self.store.iter_embeddings())
            result = Reconciliation(len(missing), len(dead), is_rebuilt=True)
        else:
            if dead:
                self.index.remove(dead)
            if missing:
                self.index.add(*self.store.embeddings_of(missing))  # each into its collection's index
            result = Reconciliation(len(missing), len(dead))
        self.index.save()
        return result

    def search(self, question: str, top_k: int, collections: Sequence[str], mode: RetrievalMode = RetrievalMode.DENSE,
               num_candidates: int = 0, rrf_k: int = RetrievalConfig.rrf_k,
               vector: np.ndarray | None = None) -> list[ScoredChunk]:
        """The `top_k` best chunks of `collections` for `question`, best first, each with its cosine
        similarity to it. Hybrid fuses the dense and the lexical rankings, each `num_candidates` deep (at
        least top_k), by reciprocal rank with constant `rrf_k`, and where the question names something
        (`named_words`, each as written) held by at most that many chunks, a third ranking of the chunks
        holding the names (`names_ranking`). `vector`: the question's embedding, if already made."""
        allowed = set(collections)  # the store's word, not the index's, on where a chunk lives
        if mode is RetrievalMode.HYBRID:
            depth = max(top_k, num_candidates)
            # the lexical ranking and the names' chunks need no embedding: the store makes them (Postgres's
            # backend, or SQLite in C without the GIL) while the question is embedded (docs/benchmarks/retrieval.md)
            lexical = self._side.submit(self.store.lexical_search, question, depth, collections)
            names = named_words(question)
            named = self._side.submit(self.store.name_hits, names, depth, collections) if names else None
            vector = self.embedder.encode_one(question) if vector is None else vector
            dense = {h.row_id: h.score for h in self.index.search(vector, depth, collections)}  # best first
            rankings = [list(dense), [row_id for row_id, _ in lexical.result()]]
            held = _names_held(named.result()) if named is not None else {}
            if held:  # a third ranking: the chunks holding the question's names
                rankings.append(names_ranking(reciprocal_rank_fusion(rankings, rrf_k), held))
            fused = self.store.fused_rows(reciprocal_rank_fusion(rankings, rrf_k)[:top_k], dense.keys())
            # a hit the dense ranking did not reach: its cosine from its stored embedding
            return [ScoredChunk(hit.chunk, dense.get(hit.chunk.row_id) if hit.embedding is None
                                else float(hit.embedding @ vector), hit.rank_score, held.get(hit.chunk.row_id, ()))
                    for hit in fused if hit.chunk.collection in allowed]
        vector = self.embedder.encode_one(question) if vector is None else vector
        if mode is RetrievalMode.DENSE:
            ranked = [(h.row_id, h.score) for h in self.index.search(vector, top_k, collections)]
        else:
            ranked = self.store.lexical_search(question, top_k, collections)
        chunks = self.store.chunks_by_row_ids([row_id for row_id, _ in ranked])
        cosines = dict(ranked) if mode is RetrievalMode.DENSE else {}
        unscored = [row_id for row_id, _ in ranked if row_id not in cosines and row_id in chunks]
        if unscored:  # lexical: the chunks' cosines from their stored embeddings
            batch = self.store.embeddings_of(unscored)
            cosines.update(zip(batch.row_ids.tolist(), (batch.vectors @ vector).tolist() if len(batch.row_ids) else []))
        return [ScoredChunk(chunks[i], cosines.get(i), rank_score) for i, rank_score in ranked
                if i in chunks and chunks[i].collection in allowed]

    def question_words(self, question: str, collections: Sequence[str], names: bool = True,
                       words: bool = True) -> QuestionWords:
        """What of the question no chunk of `collections` holds, in one store call (none when there is
        nothing to look up): with `names`, what it names (`named_words`: "CUPS", "bzip2", "core.autocrlf")
        that no chunk mentions, a name being mentioned when each of its parts is somewhere in them; with
        `words`, its words (`query_terms`: stop words left out) that no chunk holds, stemmed as the
        lexical index is ("listens" is held by "listen")."""
        named = {name: word_parts(name) for name in named_words(question)} if names else {}
        terms = query_terms(question) if words else []
        lookups = list(dict.fromkeys([p for parts in named.values() for p in parts] + terms))
        missing = set(self.store.missing_words(lookups, collections))  # nothing to look up: no query, both stores
        return QuestionWords(tuple(name for name, parts in named.items() if any(p in missing for p in parts)),
                             tuple(w for w in terms if w in missing))

    def checked_search(self, question: str, top_k: int, collections: Sequence[str], mode: RetrievalMode,
                       num_candidates: int, rrf_k: int, names: bool, words: bool) -> CheckedSearch:
        """`search`, and `question_words` looked up beside it on a side thread (the server's retrieval:
        the lookup's round trip is not waited for after the ranking; with both checks off, no hop)."""
        checked = self._side.submit(self.question_words, question, collections, names, words) \
            if names or words else None
        scored = self.search(question, top_k, collections, mode, num_candidates, rrf_k)
        return CheckedSearch(scored, QuestionWords() if checked is None else checked.result())

    def named(self, chunk_ids: Sequence[str], collections: Sequence[str]) -> tuple[list[ScoredChunk], list[str]]:
        """The chunks of `collections` with these ids in this order, and the ids that are not there
        (none such, or in another collection: the two read alike)."""
        found = self.store.chunks_by_ids(chunk_ids, collections)
        missing = [cid for cid in chunk_ids if cid not in found]
        return [ScoredChunk(found[cid], None) for cid in chunk_ids if cid in found], missing

    def follow(
        self, removed: Sequence[StoredChunk], added: Sequence[StoredChunk], added_vectors: Sequence[np.ndarray]
    ) -> None:
        """Make the index follow a committed store write: drop `removed` chunks, add the `added` ones
        (with their embeddings `added_vectors`), each in its collection's index."""
        with self._follow_lock:
            self._follow(removed, added, added_vectors)

    def _follow(
        self, removed: Sequence[StoredChunk], added: Sequence[StoredChunk], added_vectors: Sequence[np.ndarray]
    ) -> None:
        indexed = set(self.index.ids().tolist())  # a replica's catch-up may have added them already
        keep = [(c, v) for c, v in zip(added, added_vectors) if c.row_id not in indexed]
        removed = [c for c in removed if c.row_id in indexed]
        if removed and not self.index.supports_remove:  # the store already holds the new chunks
            self.index.rebuild(self.store.iter_embeddings(), collections={c.collection for c in removed})
            keep = [(c, v) for c, v in keep if c.collection not in {r.collection for r in removed}]
        elif removed:
            self.index.remove(c.row_id for c in removed)
        if keep:
            self.index.add([c.row_id for c, _ in keep], np.stack([v for _, v in keep]), [c.collection for c, _ in keep])

    def catch_up(self) -> CatchUp:
        """Make the index follow the commits other replicas made to a shared store since `self.seq`:
        each touched row id is dropped from the index unless it is live, and added if live and
        missing (idempotent, whatever the order of the commits or this process's own follow())."""
        with self._follow_lock:
            changes = self.store.changes_since(self.seq)
            if not changes.is_complete:
                seq = self.store.change_seq()
                result = self._reconcile()
                self.seq = seq
                return CatchUp(seq, result.num_added, result.num_removed, is_reconciled=True)
            if not changes.row_ids:
                self.seq = changes.seq
                return CatchUp(self.seq)
            indexed = set(self.index.ids().tolist()) & changes.row_ids
            live_ids, live_vectors, live_collections = self.store.embeddings_of(sorted(changes.row_ids))
            live = set(live_ids.tolist())
            dead, keep = indexed - live, [n for n, i in enumerate(live_ids.tolist()) if i not in indexed]
            if dead and not self.index.supports_remove:
                self.index.rebuild(self.store.iter_embeddings())
            else:
                if dead:
                    self.index.remove(sorted(dead))
                if keep:
                    self.index.add(live_ids[keep], live_vectors[keep], [live_collections[n] for n in keep])
            self.seq = changes.seq
            return CatchUp(self.seq, len(keep), len(dead))

    def close(self) -> None:
        self._side.shutdown()  # a lexical ranking under way ends before its store closes
        self.index.save()
        self.store.close()


def _names_held(name_hits: dict[str, list[int]]) -> dict[int, tuple[str, ...]]:
    """Row id -> the names it holds, in the question's order (`DocumentStore.name_hits`'s result turned round)."""
    held: dict[int, tuple[str, ...]] = {}
    for name, row_ids in name_hits.items():
        for row_id in row_ids:
            held[row_id] = (*held.get(row_id, ()), name)
    return held


def names_ranking(ranked: Sequence[tuple[int, float]], held: dict[int, tuple[str, ...]]) -> list[int]:
    """The chunks holding the question's names (`held`: row id -> names), those holding more first, in the
    fused ranking's order (`ranked`: (row id, score), best first) among those holding as many, then by row id
    (their document's order) where no ranking reached them. A third ranking for the fusion: a question
    asking for an entry by its name ("What is LineMax= set to?") wants the chunk stating it, which neither
    the embedding nor the words need place high (its line is a few tokens among many entries like it), while
    a name that is also the document's ("nsswitch.conf") is in chunks that do not answer: a ranking of its
    own moves them up without putting them first (docs/design/retrieval.md#names)."""
    order = {row_id: i for i, (row_id, _) in enumerate(ranked)}
    return sorted(held, key=lambda row_id: (-len(held[row_id]), order.get(row_id, len(order)), row_id))


def _drop_stale_indexes(data_dir: Path, embedder_identity: str, is_stale: bool) -> None:
    """Delete the vector indexes under `data_dir` when another embedder built them (`index/embedder`
    names the one that did; a replica's own indexes after another replica embedded the shared store
    again) or when `is_stale`, so that they are rebuilt from the store; then record this embedder."""
    directory = data_dir / "index"
    marker = directory / "embedder"
    recorded = marker.read_text().strip() if marker.is_file() else None
    if is_stale or (recorded is not None and recorded != embedder_identity):
        for path in [*directory.glob("*.faiss"), data_dir / "index.faiss"]:
            path.unlink(missing_ok=True)
        logger.warning("vector indexes built by another embedder (%s): rebuilt from the store", recorded)
    directory.mkdir(parents=True, exist_ok=True)
    if recorded != embedder_identity:
        marker.write_text(embedder_identity + "\n")
