"""Retrieval without the LLM: chunker, the document store (SQLite and Postgres: every store test runs
against both), FAISS index, and the retriever with real MiniLM."""

from __future__ import annotations

import re
import threading

import faiss
import numpy as np
import pytest

from configs.enums import ChunkingMode, IndexKind
from retrieval.config import RetrievalConfig
from retrieval.chunker import Chunker
from retrieval.doc_store import NewChunk
from retrieval.index import CollectionIndexes, VectorIndex, collection_of_stem, index_file_stem
from retrieval.retriever import Retriever
from retrieval.store_types import CollectionRow


class WordVocab:
    """A real (if simple) tokenizer: one id per word or punctuation mark, with a reversible vocabulary."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.words: list[str] = []

    def encode(self, text: str) -> list[int]:
        out = []
        for word in re.findall(r"\w+|[^\w\s]", text):
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


def _sentences(num: int) -> str:
    return " ".join(f"Sentence number {i} talks about topic {i % 7} in detail." for i in range(num))


def test_chunker_packs_sentences_within_the_size_and_overlaps():
    vocab = WordVocab()
    chunker = Chunker(vocab.encode, vocab.decode, max_tokens=40, num_overlap_tokens=12)
    chunks = chunker.split(_sentences(20))
    assert len(chunks) > 3
    for chunk in chunks:
        assert 0 < chunk.num_tokens <= 40
        assert chunk.text.startswith("Sentence") and chunk.text.endswith(".")  # cut at sentence ends
    for before, after in zip(chunks, chunks[1:]):  # the last sentence of a chunk opens the next one
        last_sentence = before.text.split(". ")[-1]
        assert after.text.startswith(last_sentence.rstrip(".") + ".")


def test_chunker_cuts_paragraphs_and_overlong_sentences():
    vocab = WordVocab()
    chunker = Chunker(vocab.encode, vocab.decode, max_tokens=10, num_overlap_tokens=0)
    text = "Short one.\n\nword " * 1 + " ".join(["long"] * 25)
    chunks = chunker.split(text)
    assert chunks[0].text == "Short one."
    assert [c.num_tokens for c in chunks[1:]] == [10, 10, 6]


def test_chunking_none_keeps_one_passage_one_chunk_and_blank_gives_nothing():
    vocab = WordVocab()
    chunker = Chunker(vocab.encode, vocab.decode, max_tokens=10, num_overlap_tokens=2)
    assert len(chunker.split(_sentences(10), ChunkingMode.NONE)) == 1
    assert chunker.split("   \n ") == []
    with pytest.raises(ValueError, match="overlap"):
        Chunker(vocab.encode, vocab.decode, max_tokens=10, num_overlap_tokens=10)


def _chunk(text: str, dim: int = 4, seed: int = 0, key: str | None = None) -> NewChunk:
    vector = np.random.default_rng(seed).normal(size=dim).astype(np.float32)
    return NewChunk(text, (1, 2, 3), vector / np.linalg.norm(vector), key)


def test_document_store_replaces_deletes_and_never_reuses_row_ids(open_store):
    store = open_store()
    doc, replaced, _ = _astuple(store.put_document("a", "A", {"k": 1}, 10, [_chunk("x", key="k1"), _chunk("y", key="k2")]))
    assert replaced == [] and [c.id for c in doc.chunks] == ["a#0", "a#1"]
    assert store.get_document("a").metadata == {"k": 1}
    first_rows = {c.row_id for c in doc.chunks}
    doc2, replaced, _ = _astuple(store.put_document("a", "A2", {}, 5, [_chunk("z", key="k2")]))
    assert {c.row_id for c in replaced} == first_rows
    assert min(c.row_id for c in doc2.chunks) > max(first_rows)
    assert store.is_kv_key_used("k2") and not store.is_kv_key_used("k1")
    assert store.get_document("a").title == "A2" and store.num_chunks() == 1
    assert store.chunks_by_ids(["a#0", "missing"]).keys() == {"a#0"}
    assert [c.text for c in store.delete_document("a")] == ["z"]
    assert store.delete_document("a") is None and store.get_document("a") is None and store.num_chunks() == 0


def test_document_store_counts_tokens_and_lists_kv_keys_per_document(open_store):
    store = open_store()
    store.put_document("a", None, {}, 1, [_chunk("x", key="k1"), _chunk("y")])
    store.put_document("b", None, {"chunk_pages": [3], "chunk_last_pages": [4]}, 1, [_chunk("z", key="k3")])
    assert store.kv_keys_by_document(["a", "b", "none"]) == {"a": ["k1", None], "b": ["k3"], "none": []}
    assert store.num_chunk_tokens() == 9  # three chunks of (1, 2, 3)
    assert store.get_document("b").chunks[0].pages == (3, 4) and store.get_document("a").chunks[0].pages is None


def _astuple(result):
    return result.document, result.replaced, result.is_unchanged


def test_a_put_of_the_stored_content_hash_writes_nothing(open_store):
    """Two replicas committing the same document: the second finds its content stored, keeps it."""
    store = open_store()
    first = store.put_document("a", "A", {}, 2, [_chunk("x", key="k1")], content_hash="h1")
    again = store.put_document("a", "A", {}, 2, [_chunk("x", key="k1")], content_hash="h1")
    assert again.is_unchanged and again.replaced == []
    assert [c.row_id for c in again.document.chunks] == [c.row_id for c in first.document.chunks]
    other = store.put_document("a", "A", {}, 2, [_chunk("y", key="k2")], content_hash="h2")
    assert not other.is_unchanged and [c.row_id for c in other.replaced] == [c.row_id for c in first.document.chunks]


def test_store_exports_whole_documents_with_embeddings(open_store):
    store = open_store()
    store.put_document("a", "A", {"n": 1}, 2, [_chunk("x", seed=1, key="k1"), _chunk("y", seed=2)], content_hash="h")
    [exported] = list(store.export_documents())
    assert (exported.document.id, exported.document.metadata, exported.content_hash) == ("a", {"n": 1}, "h")
    assert [(c.text, c.kv_key) for c in exported.chunks] == [("x", "k1"), ("y", None)]
    assert np.allclose(exported.chunks[0].embedding, _chunk("x", seed=1).embedding)


@pytest.mark.parametrize("kind", list(IndexKind))
def test_index_search_remove_and_persist(tmp_path, kind):
    rng = np.random.default_rng(0)
    vectors = rng.normal(size=(50, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(8, kind, path=tmp_path / "index.faiss")
    index.add(np.arange(100, 150), vectors)
    assert index.search(vectors[7], 3)[0].row_id == 107
    if index.supports_remove:
        assert index.remove([107]) == 1
    else:
        index.rebuild([(np.delete(np.arange(100, 150), 7), np.delete(vectors, 7, axis=0))])
    assert 107 not in [h.row_id for h in index.search(vectors[7], 5)]
    index.save()
    loaded = VectorIndex.load_or_create(tmp_path / "index.faiss", 8, kind)
    assert loaded.num_vectors == 49 and loaded.loaded_kind is kind
    with pytest.raises(ValueError, match="dim"):
        VectorIndex.load_or_create(tmp_path / "index.faiss", 16, kind)


def test_collections_differing_by_case_get_index_files_that_cannot_collide(tmp_path):
    """`TEAM-A.faiss` and `team-a.faiss` are one file on a case-insensitive filesystem (macOS's,
    Windows'): every file name is in lower case, one per collection, and reads back as its collection."""
    names = ["TEAM-A", "team-a", "Team-A", "default", "a.B_c-9", "x.faiss"]
    for name in names:
        stem = index_file_stem(name)
        assert stem == stem.lower() and collection_of_stem(stem) == name
    assert index_file_stem("team-a") == "team-a" and collection_of_stem("TEAM-A") is None  # lower case: unchanged
    rng = np.random.default_rng(1)
    vectors = rng.normal(size=(len(names), 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    indexes = CollectionIndexes(tmp_path / "index", 8)
    for i, name in enumerate(names):
        indexes.add([i], vectors[i : i + 1], [name])
    indexes.save()
    files = sorted((tmp_path / "index").glob("*.faiss"))
    assert len(files) == len(names) == len({path.name.lower() for path in files})
    loaded = CollectionIndexes.load_or_create(tmp_path / "index", 8, IndexKind.FLAT)
    assert loaded.collections == sorted(names)
    for i, name in enumerate(names):
        assert [hit.row_id for hit in loaded.search(vectors[i], 5, [name])] == [i]


def test_index_files_named_before_are_rebuilt_from_the_store(tmp_path):
    """A data directory from before case-safe names (no `index/layout`): on a case-insensitive
    filesystem `team-a.faiss` may hold `TEAM-A`'s vectors, and no file name tells. Its files are
    deleted and every chunk indexed again from the store's embeddings, each in its own collection's."""
    retriever = Retriever.open(tmp_path, RetrievalConfig())
    texts = {"TEAM-A": "The violet zeppelin lands in Oslo.", "team-a": "Old harbours smell of tar."}
    row_ids = {}
    for (name, text), vector in zip(texts.items(), retriever.embedder.encode(list(texts.values()))):
        retriever.store.create_collection(CollectionRow(name, "", 1.0, f"salt-{name}"))
        put = retriever.store.put_document("doc", None, {}, len(text), [NewChunk(text, (1,), vector)], collection=name)
        row_ids[name] = (put.document.chunks[0].row_id, vector)
    retriever.close()
    index_dir = tmp_path / "index"
    for path in [*index_dir.glob("*.faiss"), index_dir / "layout"]:
        path.unlink(missing_ok=True)
    shared = VectorIndex(384, IndexKind.FLAT, path=index_dir / "team-a.faiss")  # the one file both wrote
    row_id, vector = row_ids["TEAM-A"]
    shared.add(np.array([row_id]), vector[None])  # TEAM-A's vector, saved last
    shared.save()
    reopened = Retriever.open(tmp_path, RetrievalConfig())
    try:
        for name in texts:
            hits = reopened.search("Where does the violet zeppelin land?", 3, [name])
            assert [(h.chunk.collection, h.chunk.row_id) for h in hits] == [(name, row_ids[name][0])]
        assert (index_dir / "layout").is_file() and (index_dir / "~t~e~a~m-~a.faiss").is_file()
    finally:
        reopened.close()


@pytest.mark.parametrize("search_threads", [1, 2])
def test_a_search_runs_faiss_on_search_threads_and_puts_the_callers_setting_back(search_threads):
    """FAISS's OpenMP setting is per thread: a search sets the configured count in the caller's thread and
    restores the caller's own after, so an ingest in that thread keeps it."""
    seen: list[int] = []

    class Recording(VectorIndex):  # a real index that notes the thread count its search ran under
        def search(self, query: np.ndarray, top_k: int):
            seen.append(faiss.omp_get_max_threads())
            return super().search(query, top_k)

    indexes = CollectionIndexes(None, 8, search_threads=search_threads)
    shard = Recording(8)
    shard.add(np.arange(3), np.eye(3, 8, dtype=np.float32))
    indexes._adopt("default", shard)
    after: list[int] = []

    def ask() -> None:  # in a thread of its own: the test's thread keeps its setting whatever happens
        faiss.omp_set_num_threads(3)
        assert [h.row_id for h in indexes.search(np.eye(1, 8, dtype=np.float32)[0], 1, ["default"])] == [0]
        after.append(faiss.omp_get_max_threads())

    worker = threading.Thread(target=ask)
    worker.start()
    worker.join()
    assert seen == [search_threads] and after == [3]


@pytest.fixture(scope="module")
def retriever(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("retrieval")
    retriever = Retriever.open(data_dir, RetrievalConfig())
    texts = {
        "vault": "The secret code of the blue vault is 4812.",
        "bridge": "The red bridge in Lisbon was painted in 1966 by forty workers.",
        "cheese": "The cheese festival takes place in Wensleydale every October.",
    }
    for doc_id, text in texts.items():
        vector = retriever.embedder.encode([text])[0]
        doc = retriever.store.put_document(doc_id, None, {}, len(text), [NewChunk(text, (1,), vector)]).document
        retriever.index.add([doc.chunks[0].row_id], vector[None], ["default"])
    yield retriever, data_dir
    retriever.close()


def test_embedder_is_normalised_and_search_finds_the_answer(retriever):
    retriever, _ = retriever
    vectors = retriever.embedder.encode(["a", "b c d"])
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    for text in ("a", "What is the code of the blue vault?", "word " * 400):  # the question's path, bit for bit
        one = retriever.embedder.encode_one(text)
        assert one.shape == (384,) and one.dtype == np.float32
        assert np.array_equal(one, retriever.embedder.encode([text])[0])
    hits = retriever.search("What is the code of the blue vault?", 2, ["default"])
    assert [h.chunk.document_id for h in hits][0] == "vault" and hits[0].score > hits[1].score
    found, missing = retriever.named(["cheese#0", "nope#0", "vault#0"], ["default"])
    assert [s.chunk.id for s in found] == ["cheese#0", "vault#0"] and missing == ["nope#0"]


def test_retriever_rebuilds_a_lost_index_from_the_store(retriever):
    retriever, data_dir = retriever
    retriever.index.save()
    (data_dir / "index" / "default.faiss").unlink()
    reopened = Retriever.open(data_dir, RetrievalConfig(index=IndexKind.HNSW))
    assert reopened.index.num_vectors == 3 and reopened.index.loaded_kind is IndexKind.HNSW
    assert reopened.search("Which festival is in October?", 1, ["default"])[0].chunk.document_id == "cheese"
    deleted = reopened.store.delete_document("cheese")
    reopened.follow(deleted, [], [])
    assert "cheese" not in [h.chunk.document_id for h in reopened.search("Which festival is in October?", 3, ["default"])]


def _put(retriever, doc_id, texts):
    vectors = retriever.embedder.encode(texts)
    chunks = [NewChunk(t, (i + 1,), v) for i, (t, v) in enumerate(zip(texts, vectors))]
    result = retriever.store.put_document(doc_id, None, {}, sum(map(len, texts)), chunks)
    return (result.document, result.replaced), vectors


@pytest.mark.parametrize("kind", list(IndexKind))
def test_a_crash_between_the_commit_and_the_index_is_reconciled_by_id_sets(tmp_path, kind, open_store):
    """A replace with as many chunks as before, killed after the store's commit and before the index
    follows: the counts match, the ids do not. Start-up must swap the dead ids for the new chunks."""
    settings = RetrievalConfig(index=kind)
    retriever = Retriever.open(tmp_path, settings, open_store())
    (doc, _), vectors = _put(retriever, "ships", ["Old ships sail at dawn.", "Old harbours smell of tar."])
    retriever.follow([], doc.chunks, list(vectors))
    retriever.index.save()
    _put(retriever, "ships", ["The violet zeppelin lands in Oslo.", "Zeppelins carry forty passengers."])
    retriever.store.close()  # killed here: the index file still holds the old ids
    reopened = Retriever.open(tmp_path, settings, open_store())
    assert set(reopened.index.ids().tolist()) == reopened.store.row_ids()
    hit = reopened.search("Where does the violet zeppelin land?", 1, ["default"])[0]
    assert hit.chunk.text == "The violet zeppelin lands in Oslo."
    assert Retriever.open(tmp_path, settings, open_store()).reconcile().is_changed is False  # in step now
    reopened.close()


def test_reconcile_adds_missing_removes_dead_and_survives_an_unreadable_index(tmp_path, open_store):
    retriever = Retriever.open(tmp_path, RetrievalConfig(), open_store())
    (a, _), vectors = _put(retriever, "a", ["Alpha one.", "Alpha two."])
    retriever.index.add([999], vectors[:1], ["default"])  # a dead id: no chunk has it
    result = retriever.reconcile()
    assert (result.num_added, result.num_removed, result.is_rebuilt) == (2, 1, False)
    assert set(retriever.index.ids().tolist()) == {c.row_id for c in a.chunks}
    retriever.close()
    (tmp_path / "index" / "default.faiss").write_bytes(b"not a faiss index")
    reopened = Retriever.open(tmp_path, RetrievalConfig(), open_store())
    assert set(reopened.index.ids().tolist()) == {c.row_id for c in a.chunks}
    reopened.close()


def test_store_lists_with_counts_and_keeps_content_hashes(open_store):
    store = open_store()
    store.put_document("a", "A", {}, 3, [_chunk("x", key="k1"), _chunk("y", key="k2")], content_hash="h1")
    store.put_document("b", None, {}, 1, [_chunk("z")])
    assert [(r.id, r.num_chunks) for r in store.list_documents()] == [("a", 2), ("b", 1)]
    assert store.content_hash("a") == "h1" and store.content_hash("b") is None and store.content_hash("c") is None
    assert store.kv_keys() == {"k1", "k2"} and len(store.row_ids()) == 3
    assert store.num_documents() == 2 and store.num_chunks() == 3


@pytest.mark.parametrize("kind", list(IndexKind))
def test_follow_a_replace_leaves_each_chunk_indexed_once(tmp_path, kind, open_store):
    """HNSW cannot remove: the index is rebuilt from the store, which already holds the new chunks
    (adding them again would index them twice)."""
    retriever = Retriever.open(tmp_path, RetrievalConfig(index=kind), open_store())
    (doc, _), vectors = _put(retriever, "a", ["Alpha one.", "Alpha two."])
    retriever.follow([], doc.chunks, list(vectors))
    (doc2, replaced), vectors2 = _put(retriever, "a", ["Beta one.", "Beta two.", "Beta three."])
    retriever.follow(replaced, doc2.chunks, list(vectors2))
    ids = retriever.index.ids().tolist()
    assert sorted(ids) == sorted(retriever.store.row_ids()) and len(ids) == 3
    retriever.close()
