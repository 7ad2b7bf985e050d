"""Lexical and hybrid retrieval: the stores' full-text indexes (SQLite FTS5, Postgres tsvector + GIN)
with real MiniLM beside them, reciprocal rank fusion against a hand computation, the index written in
the chunks' own transaction (a process killed between the two writes leaves nothing half-written), removed
with its document, kept to the request's collections, and filled by the schema migration of a store made
before it (both stores)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import psycopg
import pytest

from configs.enums import RetrievalMode
from retrieval.config import RetrievalConfig
from retrieval.doc_store import SqliteDocumentStore, lexical_query, missing_word_query, name_hit_query
from retrieval.lexical import fts5_query, named_words, query_terms, reciprocal_rank_fusion, word_parts
from retrieval.pg_store import SCHEMA_VERSION, PostgresDocumentStore
from retrieval.retriever import RelevanceFloor, Retriever, ScoredChunk, names_ranking
from retrieval.store_types import (
    DEFAULT_COLLECTION, CollectionRow, DocumentStore, NewChunk, StoredChunk, rows_of_ranking,
)

ROOT = Path(__file__).resolve().parent.parent
ALL = (DEFAULT_COLLECTION,)  # the collections searched


def _put(retriever: Retriever, doc_id: str, texts: list[str]):
    vectors = retriever.embedder.encode(texts)
    result = retriever.store.put_document(doc_id, None, {}, sum(map(len, texts)),
                                          [NewChunk(t, (i + 1,), v) for i, (t, v) in enumerate(zip(texts, vectors))])
    retriever.follow(result.replaced, result.document.chunks, list(vectors))
    return result


LIGHTHOUSE = "Which colour is the Zanthorpe lighthouse?"
COAST = [  # about lighthouses and colours, without the question's words: what a dense ranking puts first
    "The harbour beacon on the northern coast is painted red and white in broad stripes.",
    "Coastal towers that guide ships at night are often whitewashed so sailors see them by day.",
    "Many seaside beacons were repainted in bright hues after the storms of the last winter.",
]
RARE = "Zanthorpe holds a cattle market every Tuesday morning."  # the one chunk holding the rare word


def test_a_rare_word_ranks_its_chunk_first_in_lexical_and_hybrid(open_store, tmp_path):
    retriever = Retriever.open(tmp_path, RetrievalConfig(), open_store())
    _put(retriever, "coast", COAST)
    _put(retriever, "town", [RARE, "The village school closes for the summer in July."])
    dense = retriever.search(LIGHTHOUSE, 3, ALL, RetrievalMode.DENSE)
    lexical = retriever.search(LIGHTHOUSE, 3, ALL, RetrievalMode.LEXICAL)
    hybrid = retriever.search(LIGHTHOUSE, 3, ALL, RetrievalMode.HYBRID, num_candidates=10)
    assert dense[0].chunk.text != RARE  # the embeddings prefer the coast: only the words find it
    assert [s.chunk.text for s in lexical] == [RARE]  # the only chunk holding one of the question's words
    assert hybrid[0].chunk.text == RARE and len(hybrid) == 3
    # every result says its cosine similarity, however it was ranked (a lexical hit's from its stored embedding)
    vector = retriever.embedder.encode([LIGHTHOUSE])[0]
    expected = float(retriever.embedder.encode([RARE])[0] @ vector)
    assert lexical[0].score == pytest.approx(expected, abs=1e-5) and hybrid[0].score == pytest.approx(expected, abs=1e-5)
    assert lexical[0].rank_score > 0 and hybrid[0].rank_score == pytest.approx(1 / 61 + 1 / (60 + _rank(dense, retriever, LIGHTHOUSE)))
    retriever.close()


def _rank(dense: list[ScoredChunk], retriever: Retriever, question: str) -> int:
    """The rare chunk's 1-based rank in the dense ranking over every chunk."""
    ranking = retriever.search(question, 10, ALL, RetrievalMode.DENSE)
    return next(i for i, s in enumerate(ranking, 1) if s.chunk.text == RARE)


def test_lexical_matches_stemmed_words_and_ignores_question_words(open_store, tmp_path):
    store = open_store()
    retriever = Retriever.open(tmp_path, RetrievalConfig(), store)
    _put(retriever, "a", ["The daemon compresses files with gzip.", "What is the colour of the sky?"])
    hits = store.lexical_search("Which tool compressed the files?", 5, ALL)  # compressed ~ compresses, files
    assert [retriever.store.chunks_by_row_ids([i])[i].text for i, _ in hits] == ["The daemon compresses files with gzip."]
    assert store.lexical_search("What is it?", 5, ALL) == []  # only question words: nothing to match on (both stores)
    assert store.lexical_search('"OR NEAR( * -', 5, ALL) == []  # no FTS syntax reaches the index: no error
    retriever.close()


def test_lexical_and_hybrid_search_only_the_requested_collections(open_store, store_kind, tmp_path):
    store = open_store()
    store.create_collection(CollectionRow("other", "", 0.0, "salt-other"))
    retriever = Retriever.open(tmp_path, RetrievalConfig(), store)
    _put(retriever, "coast", COAST)
    vectors = retriever.embedder.encode([RARE])
    result = store.put_document("town", None, {}, len(RARE), [NewChunk(RARE, (1,), vectors[0])], collection="other")
    retriever.follow([], result.document.chunks, list(vectors))
    assert store.lexical_search("Zanthorpe", 5, ALL) == []  # another collection's word: not found here
    assert len(store.lexical_search("Zanthorpe", 5, ("other",))) == 1
    for mode in RetrievalMode:
        assert all(s.chunk.collection == DEFAULT_COLLECTION for s in retriever.search(LIGHTHOUSE, 5, ALL, mode))
        assert [s.chunk.text for s in retriever.search(LIGHTHOUSE, 1, ("other",), mode)] == [RARE]
    retriever.follow(store.delete_collection("other"), [], [])  # a whole collection: its lexical rows go too
    assert _lexical_rows(store, store_kind) == {c.row_id: c.text for c in store.get_document("coast").chunks}
    retriever.close()


def test_reciprocal_rank_fusion_against_a_hand_computation():
    dense, lexical = ["a", "b", "c", "d"], ["c", "e", "a"]
    fused = reciprocal_rank_fusion([dense, lexical], k=60)
    hand = {"a": 1 / 61 + 1 / 63, "b": 1 / 62, "c": 1 / 63 + 1 / 61, "d": 1 / 64, "e": 1 / 62}
    assert dict(fused) == pytest.approx(hand)
    # a and c tie (each 1st in one ranking, 3rd in the other): the dense ranking's order breaks the tie;
    # so do b and e (2nd in one ranking each)
    assert [key for key, _ in fused] == ["a", "c", "b", "e", "d"]
    fused_k1 = reciprocal_rank_fusion([dense, lexical], k=1)  # a small k rewards the top ranks more
    assert [key for key, _ in fused_k1] == ["a", "c", "b", "e", "d"]
    assert dict(fused_k1)["a"] == pytest.approx(1 / 2 + 1 / 4)
    assert reciprocal_rank_fusion([[], []], k=60) == []


def test_postgres_reads_a_fused_rankings_rows_in_one_statement_as_the_stores_calls_do(postgres):
    """Postgres's `fused_rows` (the rows and the lexical-only hits' embeddings in one statement) against
    `rows_of_ranking` (chunks_by_row_ids, embeddings_of) on the same store, for hybrid's fused rankings:
    the same chunks in the ranking's order, the same scores, the same embeddings for the chunks the dense
    ranking did not hold, none for those it did. Random dense rankings make many ties (a dense-only and a
    lexical-only chunk at the same rank): the dense one goes first."""
    import random

    from bench.harness.sets import DEFAULT_SET, load_set

    rng = random.Random(7)
    store = PostgresDocumentStore(postgres.new_database())
    try:
        lines = [" ".join(line.split()) for path in sorted((ROOT / "bench" / "data" / "answers" / "docs").glob("*"))
                 if path.suffix in (".txt", ".md") for line in path.read_text(errors="replace").splitlines()]
        texts = [t for t in dict.fromkeys(lines) if len(t) > 30]
        for first in range(0, len(texts), 10):
            part = texts[first : first + 10]
            vectors = np.asarray([rng.gauss(0, 1) for _ in range(4 * len(part))], np.float32).reshape(len(part), 4)
            store.put_document(f"d{first}", None, {}, 1, [NewChunk(t, (1,), v) for t, v in zip(part, vectors)])
        with psycopg.connect(store.url, autocommit=True) as conn:
            conn.execute("ANALYZE chunks")  # the common words' statistics, as autovacuum leaves them
        row_ids = sorted(store.row_ids())
        questions = [q.question for q in load_set(DEFAULT_SET).questions] + ["what is the", "", "zzqx unknownword"]
        num_lexical_only = num_dense = 0
        for number, question in enumerate(questions):
            dense = rng.sample(row_ids, 20) if number % 7 else []  # some questions with no dense ranking
            if number % 5 == 0:
                dense[:1] = [max(row_ids) + 1000]  # a chunk gone since the index saw it
            lexical = [row_id for row_id, _ in store.lexical_search(question, 20, ALL)]
            ranked = reciprocal_rank_fusion([dense, lexical], 60)[:10]
            expected = rows_of_ranking(store, ranked, set(dense))
            fused = store.fused_rows(ranked, set(dense))
            assert [h.chunk.row_id for h in fused] == [row_id for row_id, _ in ranked if row_id in row_ids], question
            assert [h.chunk for h in fused] == [h.chunk for h in expected], question
            assert [h.rank_score for h in fused] == [h.rank_score for h in expected], question
            for got, want in zip(fused, expected):
                assert (got.embedding is None) == (want.embedding is None) == (got.chunk.row_id in dense)
                assert got.embedding is None or np.array_equal(got.embedding, want.embedding)
                num_lexical_only += got.embedding is not None
                num_dense += got.embedding is None
        assert num_lexical_only > 50 and num_dense > 50  # both rankings did reach the results
        assert store.fused_rows([], set()) == []
    finally:
        store.close()


def test_query_terms_drop_question_words_and_quote_everything():
    assert query_terms("What is the default FIRST_UID in adduser's configuration? Don't guess.") == [
        "default", "first_uid", "adduser", "configuration", "don", "guess"]  # no "s" nor "t": in most chunks
    assert query_terms("What is it?") == []
    assert fts5_query(["a", 'b"c']) == '"a" OR "b""c"'


def test_named_words_are_what_a_question_names_not_its_wording():
    assert named_words("Which TCP port does the CUPS print server listen on by default?") == ["TCP", "CUPS"]
    assert named_words("What is the default compression level of bzip2?") == ["bzip2"]  # a digit among letters
    assert named_words("Which file holds the OpenSSH server daemon's configuration?") == ["OpenSSH"]
    assert named_words("What is the default value of the git setting core.autocrlf?") == ["core.autocrlf"]
    assert named_words("Which file sets the servers that systemd-timesyncd uses?") == ["systemd-timesyncd"]
    assert named_words("Who painted the Mona Lisa in Burma?") == []  # capitalised only: names with other names
    assert named_words("What is the default LineMax= in journald's config, and what does --repeat do?") == [
        "LineMax"]  # "=" and an option's dashes are stripped; "--repeat" is then an ordinary word
    # the wording (plain words, numbers, a capitalised first word, single letters, stop words) names nothing
    assert named_words("How many seconds does a user have to complete a login, at most 60?") == []
    assert named_words("Where does a file X go in 1.5.1, and is IT set?") == []
    assert named_words("I use wget. Explain its quota! Does X11 work?") == ["X11"]
    assert word_parts("CMAKE_BUILD_TYPE") == ["cmake", "build", "type"]
    assert word_parts("systemd-timesyncd") == ["systemd", "timesyncd"] and word_parts("The.The") == []


def test_a_name_no_chunk_of_the_collections_mentions_is_unmentioned(open_store, tmp_path):
    store = open_store()
    store.create_collection(CollectionRow("other", "", 0.0, "salt-other"))
    retriever = Retriever.open(tmp_path, RetrievalConfig(), store)
    _put(retriever, "coast", COAST + ["The systemd-journald daemon compresses logs with gzip."])
    vectors = retriever.embedder.encode([RARE])
    result = store.put_document("town", None, {}, len(RARE), [NewChunk(RARE, (1,), vectors[0])], collection="other")
    retriever.follow([], result.document.chunks, list(vectors))
    assert store.missing_words(["gzip", "compressed", "bzip2", "zanthorpe", "the"], ALL) == ["bzip2", "zanthorpe"]
    assert store.missing_words(["zanthorpe"], ("other",)) == []  # another collection's word: missing here only

    def unmentioned(question: str, collections=ALL) -> tuple[str, ...]:
        return retriever.question_words(question, collections, words=False).unmentioned_names

    assert unmentioned("Does systemd-journald use bzip2 like ZANTHORPE?") == ("bzip2", "ZANTHORPE")
    assert unmentioned("Which daemon compresses logs with GZIP?") == ()  # stems, any case
    # a name is mentioned when each of its parts is somewhere: the parts of systemd-timesyncd are not all there
    assert unmentioned("Which daemon is systemd-timesyncd?") == ("systemd-timesyncd",)
    assert unmentioned("Is ZANTHORPE coastal?", ("other",)) == ()
    retriever.close()


def test_a_checked_search_is_the_search_with_names_and_words_from_one_lookup(open_store, tmp_path):
    """The server's retrieval (`checked_search`): the same chunks as `search`, and the question's
    unmentioned names and unmatched words from one store call made beside the ranking."""
    store = open_store()
    retriever = Retriever.open(tmp_path, RetrievalConfig(), store)
    _put(retriever, "coast", COAST + ["The systemd-journald daemon compresses logs with gzip."])
    _put(retriever, "town", [RARE])
    calls = []
    missing_words = store.missing_words

    def counted(words, collections):
        calls.append(list(words))
        return missing_words(words, collections)

    store.missing_words = counted
    question = "Does Zanthorpe compress logs with bzip2 or systemd-timesyncd?"
    for mode in RetrievalMode:
        calls.clear()
        checked = retriever.checked_search(question, 3, ALL, mode, 10, 60, names=True, words=True)
        assert checked.scored == retriever.search(question, 3, ALL, mode, 10, 60)
        assert checked.words.unmentioned_names == ("bzip2", "systemd-timesyncd")  # timesyncd is in no chunk
        assert checked.words.unmatched_words == ("bzip2", "timesyncd")  # "compress" is held by "compresses"
        assert len(calls) == 1 and {"bzip2", "systemd", "timesyncd", "zanthorpe", "compress"} <= set(calls[0])
    calls.clear()
    off = retriever.checked_search(question, 3, ALL, RetrievalMode.HYBRID, 10, 60, names=False, words=False)
    assert off.words.unmentioned_names == off.words.unmatched_words == () and off.scored
    assert calls == []  # both checks off: no lookup at all
    names_only = retriever.question_words(question, ALL, words=False)
    assert names_only.unmentioned_names == ("bzip2", "systemd-timesyncd") and names_only.unmatched_words == ()
    assert retriever.question_words(question, ALL, names=False).unmentioned_names == ()
    retriever.close()


def test_a_names_chunks_are_those_holding_its_words_as_a_phrase_if_few(open_store, tmp_path):
    """`name_hits` (both stores): a name's chunks are those holding its words in its order ("fail_interval"
    in "fail_interval = 900", not in "interval ... fail"), only in the searched collections; a name held
    by more than `limit` chunks picks nothing out and is left out, as is one held by none."""
    store = open_store()
    store.create_collection(CollectionRow("other", "", 0.0, "salt-other"))
    retriever = Retriever.open(tmp_path, RetrievalConfig(), store)
    _put(retriever, "faillock", ["# The default is 900 (15 minutes).\n# fail_interval = 900",
                                 "The interval after a fail is counted again.", "# deny = 3"]
         + [f"faillock entry {i}: see journald" for i in range(6)])
    vectors = retriever.embedder.encode(["fail_interval = 10"])
    store.put_document("o", None, {}, 18, [NewChunk("fail_interval = 10", (1,), vectors[0])], collection="other")
    rows = {c.text: c.row_id for c in store.get_document("faillock").chunks}
    hits = store.name_hits(["fail_interval", "journald", "Nowhere", "faillock"], 5, ALL)
    assert hits == {"fail_interval": [rows["# The default is 900 (15 minutes).\n# fail_interval = 900"]]}
    assert set(store.name_hits(["journald"], 6, ALL)) == {"journald"} and store.name_hits([], 5, ALL) == {}
    assert len(store.name_hits(["fail_interval"], 5, ("other",))["fail_interval"]) == 1
    retriever.close()


def test_hybrid_ranks_the_chunks_holding_the_questions_names_as_a_third_ranking(open_store, tmp_path):
    """An entry asked for by its name is retrieved first where the rankings place it lower: its line is a
    few tokens among chunks that talk about the same thing at length; one no ranking reached comes in (both
    stores). A name that is the document's own is no ranking."""
    retriever = Retriever.open(tmp_path, RetrievalConfig(), open_store())
    prose = [f"Passwords are hashed with a method chosen by the administrator; the method used to encrypt them "
             f"is {m}, and changing the method re-encrypts nothing until the next change of password." for m in
             ("configurable", "set per system", "read at login", "named in the file", "checked by passwd")]
    entry = "ENCRYPT_METHOD SHA512"
    _put(retriever, "login.defs", prose + ["UMASK 022", entry, "MAIL_DIR /var/mail", "See login.defs(5)."])
    question = "Which method does ENCRYPT_METHOD use to encrypt passwords?"
    scored = retriever.search(question, 3, ALL, RetrievalMode.HYBRID, num_candidates=20)
    assert scored[0].chunk.text == entry and scored[0].matched_names == ("ENCRYPT_METHOD",)
    assert all(s.matched_names == () for s in scored[1:]) and len(scored) == 3
    # 2 deep, neither ranking reaches the entry: the names' ranking alone brings it in, one vote of three
    assert entry in [s.chunk.text for s in retriever.search(question, 4, ALL, RetrievalMode.HYBRID, num_candidates=2)]
    plain = retriever.search("Which method is used to encrypt passwords?", 4, ALL, RetrievalMode.HYBRID, num_candidates=2)
    assert entry not in [s.chunk.text for s in plain]  # without the name, the prose wins: the name moved it
    # a name the document is called by picks out no entry: no ranking of its own
    assert retriever.store.name_hits(["login.defs", "UMASK"], 20, ALL) == {"UMASK": [_row(retriever, "UMASK 022")]}
    named = retriever.search("What does login.defs say?", 3, ALL, RetrievalMode.HYBRID, num_candidates=20)
    assert all(s.matched_names == () for s in named)
    retriever.close()


def _row(retriever: Retriever, text: str) -> int:
    return next(c.row_id for c in retriever.store.get_document("login.defs").chunks if c.text == text)


def test_the_names_ranking_keeps_the_fused_order_among_chunks_holding_as_many_names():
    ranked = [(1, 0.5), (2, 0.4), (3, 0.3), (4, 0.2)]
    held = {9: ("B",), 3: ("A",), 4: ("A", "B"), 7: ("A",)}
    assert names_ranking(ranked, held) == [4, 3, 7, 9] and names_ranking(ranked, {}) == []


def test_sqlite_looks_a_word_up_in_the_index_not_chunk_by_chunk(tmp_path):
    """A word in no chunk is the case the names check refuses on: found through the index's matches, not
    by walking every chunk of the collections (which cost ~170 ms at 10 000 chunks); the lexical ranking's
    statement is planned the same way."""
    store = SqliteDocumentStore(tmp_path / "docs.db")
    vector = np.zeros(4, dtype=np.float32)
    for d in range(3):  # with chunks stored, a plain JOIN is planned chunk by chunk (the collection's index first)
        store.put_document(f"d{d}", None, {}, 10, [NewChunk(f"word{d} text {i}", (1,), vector) for i in range(4)])
    for query, params in ((missing_word_query(1), ('"bzip2"', DEFAULT_COLLECTION)),
                          (name_hit_query(1), ('"bzip2"', DEFAULT_COLLECTION, 21)),  # name_hits' too
                          (lexical_query(1), ('"bzip2"', DEFAULT_COLLECTION, 20))):  # lexical_search's too
        details = [row[-1] for row in store._conn.execute("EXPLAIN QUERY PLAN " + query, params).fetchall()]
        assert details[0].startswith("SCAN f VIRTUAL TABLE") and "SEARCH c USING" in details[1], details
    store.close()


def test_a_word_in_most_chunks_is_matched_only_when_nothing_else_is_left(tmp_path):
    """SQLite, as Postgres does by its column statistics: a question word in over COMMON_TERM_SHARE of
    the chunks is left out of the match (thousands of matches to rank for a word that weighs little;
    docs/benchmarks/retrieval.md), read as the index stores it: "one" is the index's "on", in every chunk
    here. Alone, or beside only words no chunk holds, it is matched."""
    store = SqliteDocumentStore(tmp_path / "documents.sqlite3")
    texts = ([f"Chapter {i} goes on about the {'rain' if i < 10 else 'weather'}." for i in range(40)]
             + ["The lighthouse keeper is called Ansel."])
    vectors = np.zeros((len(texts), 4), np.float32)
    store.put_document("book", None, {}, 0, [NewChunk(t, (i + 1,), v) for i, (t, v) in enumerate(zip(texts, vectors))])
    assert len(store.lexical_search("Which one keeps the lighthouse?", 50, ALL)) == 1  # the rare word's chunk
    assert len(store.lexical_search("Which one?", 50, ALL)) == 40  # nothing else: every chunk holding "on"
    # every word common: those in at most half of the chunks ("rain", in 10 of 41), not "on" (40 of 41)
    assert len(store.lexical_search("Which one is about rain?", 50, ALL)) == 10
    assert len(store.lexical_search("Which one is zanthorpe?", 50, ALL)) == 40  # a word no chunk holds changes nothing
    assert store.lexical_search("Is it zanthorpe?", 50, ALL) == []
    more = [f"Page {i} is blank." for i in range(800)]  # "on" now in 40 of 841 chunks: under 5%, matched
    store.put_document("blank", None, {}, 0,
                       [NewChunk(t, (i + 1,), np.zeros(4, np.float32)) for i, t in enumerate(more)])
    assert len(store.lexical_search("Which one keeps the lighthouse?", 50, ALL)) == 41
    store.close()


def test_postgres_matches_a_common_word_only_when_nothing_rarer_is_left(postgres):
    """Postgres's side of the same rule, by the column's statistics (ANALYZE): "lighthouse" (1 of 41
    chunks) alone; with no rare word, "rain" (10 of 41) but not "chapter" (40 of 41); alone, "chapter"."""
    url = postgres.new_database()
    store = PostgresDocumentStore(url)
    texts = ([f"Chapter {i} is about the {'rain' if i < 10 else 'weather'}." for i in range(40)]
             + ["The lighthouse keeper is called Ansel."])
    vectors = np.zeros((len(texts), 4), np.float32)
    store.put_document("book", None, {}, 0, [NewChunk(t, (i + 1,), v) for i, (t, v) in enumerate(zip(texts, vectors))])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE chunks")
    assert len(store.lexical_search("Which chapter has the lighthouse?", 50, ALL)) == 1
    assert len(store.lexical_search("Which chapter is about rain?", 50, ALL)) == 10
    assert len(store.lexical_search("Which chapter?", 50, ALL)) == 40
    store.close()


def test_the_lexical_index_follows_replaces_and_deletes(open_store, store_kind, tmp_path):
    store = open_store()
    retriever = Retriever.open(tmp_path, RetrievalConfig(), store)
    _put(retriever, "doc", ["The albatross glides over the ocean.", "Penguins cannot fly."])
    assert len(store.lexical_search("albatross", 5, ALL)) == 1
    _put(retriever, "doc", ["The condor soars above the Andes."])  # replaced: the old words are gone
    assert store.lexical_search("albatross penguins", 5, ALL) == []
    (hit,) = store.lexical_search("condor", 5, ALL)
    assert hit[0] in store.row_ids()
    assert _lexical_rows(store, store_kind) == {c.row_id: c.text for c in store.get_document("doc").chunks}
    retriever.follow(store.delete_document("doc"), [], [])
    assert store.lexical_search("condor", 5, ALL) == [] and _lexical_rows(store, store_kind) == {}
    retriever.close()


def _lexical_rows(store: DocumentStore, kind: str) -> dict[int, str]:
    """What the lexical index holds: row id -> the text it indexed (Postgres: rows whose tsvector is
    the text's)."""
    if kind == "sqlite":
        with sqlite3.connect(store.path) as conn:
            return dict(conn.execute("SELECT rowid, text FROM chunks_fts").fetchall())
    with psycopg.connect(store.url) as conn:
        return dict(conn.execute("SELECT row_id, text FROM chunks WHERE text_tsv = to_tsvector('english', text)"
                                 ).fetchall())


# ---- a store made before the lexical index ---------------------------------------------------------

OLD_SQLITE_SCHEMA = """
CREATE TABLE documents (id TEXT PRIMARY KEY, title TEXT, metadata TEXT NOT NULL, num_chars INTEGER NOT NULL,
                        created_at REAL NOT NULL, content_hash TEXT);
CREATE TABLE chunks (row_id INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
                     document_id TEXT NOT NULL REFERENCES documents(id) ON DELETE CASCADE, position INTEGER NOT NULL,
                     text TEXT NOT NULL, token_ids TEXT NOT NULL, kv_key TEXT, embedding BLOB NOT NULL);
CREATE INDEX chunks_by_document ON chunks(document_id, position);
"""
OLD_TEXTS = ["The pelican stores fish in its pouch.", "Herons stand still in shallow water."]


def test_a_sqlite_store_made_before_the_lexical_index_is_migrated_and_backfilled(tmp_path):
    path = tmp_path / "documents.sqlite3"
    with sqlite3.connect(path) as conn:  # the schema before collections and the lexical index, as written then
        conn.executescript(OLD_SQLITE_SCHEMA)
        conn.execute("INSERT INTO documents VALUES ('birds', NULL, '{}', 70, 0.0, NULL)")
        for position, text in enumerate(OLD_TEXTS):
            conn.execute("INSERT INTO chunks (id, document_id, position, text, token_ids, kv_key, embedding)"
                         " VALUES (?, 'birds', ?, ?, '[1]', NULL, ?)",
                         (f"birds#{position}", position, text, np.zeros(384, np.float32).tobytes()))
    store = SqliteDocumentStore(path)
    try:
        assert _lexical_rows(store, "sqlite") == {1: OLD_TEXTS[0], 2: OLD_TEXTS[1]}
        assert [i for i, _ in store.lexical_search("Where does the pelican keep fish?", 5, ALL)] == [1]
    finally:
        store.close()
    reopened = SqliteDocumentStore(path)  # a second open has nothing to add
    assert _lexical_rows(reopened, "sqlite") == {1: OLD_TEXTS[0], 2: OLD_TEXTS[1]}
    reopened.close()


def test_a_postgres_store_at_schema_1_is_migrated_and_backfilled(postgres):
    """Through the collections' migration (2), then the lexical index's (3)."""
    from retrieval.pg_store import _MIGRATIONS

    url = postgres.new_database()
    with psycopg.connect(url) as conn:  # the schema version 1 that main's store made, with its rows
        conn.execute(_MIGRATIONS[1])
        conn.execute("CREATE TABLE ragblend_schema (version INTEGER NOT NULL)")
        conn.execute("INSERT INTO ragblend_schema VALUES (1)")
        conn.execute("INSERT INTO documents VALUES ('birds', NULL, '{}', 70, 0.0, NULL)")
        for position, text in enumerate(OLD_TEXTS):
            conn.execute("INSERT INTO chunks (id, document_id, position, text, token_ids, kv_key, embedding)"
                         " VALUES (%s, 'birds', %s, %s, '{1}', NULL, %s)",
                         (f"birds#{position}", position, text, np.zeros(384, np.float32).tobytes()))
    store = PostgresDocumentStore(url)
    try:
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT version FROM ragblend_schema").fetchone() == (SCHEMA_VERSION,)
            assert conn.execute("SELECT count(*) FROM pg_indexes WHERE indexname = 'chunks_text_tsv'").fetchone() == (1,)
        assert _lexical_rows(store, "postgres") == {1: OLD_TEXTS[0], 2: OLD_TEXTS[1]}
        assert [i for i, _ in store.lexical_search("Where does the pelican keep fish?", 5, ALL)] == [1]
    finally:
        store.close()


# ---- killed between the chunks and their lexical rows ----------------------------------------------

CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from retrieval.store_types import NewChunk

    kind, where, target = sys.argv[1:4]
    step = sys.argv[4] if len(sys.argv) > 4 else ""

    def kill_now():
        os.kill(os.getpid(), signal.SIGKILL)

    if kind == "sqlite":
        from retrieval.doc_store import SqliteDocumentStore

        class KillingConnection:
            '''The store's connection, killing the process when a statement starts with `step`: the
            transaction holding it is then left uncommitted, as a power cut would leave it.'''

            def __init__(self, conn):
                self._conn = conn

            def __getattr__(self, name):
                return getattr(self._conn, name)

            def execute(self, sql, *args):
                if sql.startswith(step):
                    kill_now()
                return self._conn.execute(sql, *args)

            def executemany(self, sql, *args):
                if sql.startswith(step):
                    kill_now()
                return self._conn.executemany(sql, *args)

        store = SqliteDocumentStore(target)
    else:
        from retrieval import pg_store
        from retrieval.pg_store import PostgresDocumentStore

        store = PostgresDocumentStore(target)

    def chunks(texts):
        return [NewChunk(t, (1,), np.ones(4, np.float32)) for t in texts]

    store.put_document("doc", None, {}, 10, chunks(["The albatross glides over the ocean."]))
    if kind == "sqlite":
        store._conn = KillingConnection(store._conn)
    else:  # after the chunks' rows (their tsvector with them), before the commit
        pg_store.PostgresDocumentStore._log_change = lambda *args: kill_now()
    if where == "put":
        store.put_document("doc", None, {}, 10, chunks(["The condor soars.", "The kestrel hovers."]))
    else:
        store.delete_document("doc")
    print("not killed", flush=True)
""")


@pytest.mark.parametrize("where", ["put", "delete"])
def test_a_process_killed_between_the_chunks_and_the_lexical_index_leaves_nothing_half_written(
        store_kind, where, tmp_path, request):
    """The store is killed (SIGKILL) after writing a document's chunks and before their lexical rows
    (a replace), or after the lexical rows' delete and before the chunks' (a delete): reopened, the
    document is its old version whole, and the lexical index holds exactly its chunks, no new word."""
    if store_kind == "sqlite":
        target = str(tmp_path / "documents.sqlite3")
        step = "INSERT INTO chunks_fts" if where == "put" else "DELETE FROM documents"
    else:
        target, step = request.getfixturevalue("postgres").new_database(), "log_change"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.run([sys.executable, "-c", CHILD, store_kind, where, target, step], env=env,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
    if store_kind == "sqlite":  # what the file holds, before the store opens it again
        with sqlite3.connect(target) as conn:
            chunks = dict(conn.execute("SELECT row_id, text FROM chunks").fetchall())
            indexed = dict(conn.execute("SELECT rowid, text FROM chunks_fts").fetchall())
        assert indexed == chunks and len(chunks) == 1
    store = SqliteDocumentStore(target) if store_kind == "sqlite" else PostgresDocumentStore(target)
    try:
        document = store.get_document("doc")
        assert [c.text for c in document.chunks] == ["The albatross glides over the ocean."]
        assert _lexical_rows(store, store_kind) == {c.row_id: c.text for c in document.chunks}
        assert store.lexical_search("condor kestrel", 5, ALL) == [] and len(store.lexical_search("albatross", 5, ALL)) == 1
    finally:
        store.close()


# ---- the relevance floor ---------------------------------------------------------------------------


def _scored(*scores: float | None) -> list[ScoredChunk]:
    return [ScoredChunk(StoredChunk(i, f"d#{i}", "d", i, "t", (1,), None), score) for i, score in enumerate(scores)]


def test_the_relevance_floor_drops_far_below_chunks_and_everything_below_the_minimum():
    floor = RelevanceFloor(min_score=0.3, margin=0.15)
    kept = floor.apply(_scored(0.7, 0.6, 0.2, 0.56, 0.54))
    assert [s.score for s in kept] == [0.7, 0.6, 0.56]  # within 0.15 of the best, order kept
    assert floor.apply(_scored(0.29, 0.1)) == []  # the best is below the minimum: nothing is relevant
    assert [s.score for s in floor.apply(_scored(0.35, 0.25))] == [0.35]  # never below the minimum
    assert floor.apply([]) == [] and floor.apply(_scored(None)) == []
    assert len(RelevanceFloor(min_score=-1.0, margin=2.0).apply(_scored(0.9, -0.5))) == 2  # off
    # a chunk holding a name the question asks about stays, once the best reaches the minimum
    named = [_scored(0.7)[0], ScoredChunk(_scored(0.1)[0].chunk, 0.1, matched_names=("UMASK",))]
    assert [s.score for s in floor.apply(named)] == [0.7, 0.1] and floor.apply(named[1:]) == []


def test_config_rejects_an_unknown_retrieval_mode():
    with pytest.raises(ValueError):
        RetrievalConfig(mode="fuzzy")
    assert json.loads(json.dumps(RetrievalConfig(mode="hybrid").mode.value)) == "hybrid"
