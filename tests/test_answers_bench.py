"""`ragblend bench answers`: end to end on a tiny random model (servers in this process, a 2-document
set, a tiny MuSiQue file), the committed question set against its documents as the real extractors
read them, and the scoring on hand-made answers where every figure is known."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from app.cli import main
from app.extract.dispatch import extract_file
from app.config import LimitsConfig
from app.extract.types import ExtractionLimits
from bench.answers import ask as answers_bench, settings as answers_settings
from bench.answers.ask import pick_questions
from bench.answers.scoring import paired, paired_row, part_row, score_document_answer, score_musique_answer
from bench.harness.servers import deep_merge
from bench.harness.stats import in_turn
from bench.harness.sets import CONFIG_SET, DEFAULT_SET, HOLDOUT2_SET, HOLDOUT_SET, collapse, contains_gold, load_set
from bench.answers.settings import Setting, settings_named
from bench.harness.client import StreamedAnswer
from tests.docgen import make_pdf

MODEL_FROM_YAML = True  # its servers' model is the YAML config's (tests/conftest.py)

TINY_CONFIG = 'model: {"name": "random:tiny-llama", "device": "cpu"}\n'
ROW_KEYS = {"num_questions", "num_answers", "num_errors", "errors", "right", "num_right", "inside", "num_inside",
            "right_when_inside", "source_top", "source_any", "num_source_scored", "ran_to_cap", "num_ran_to_cap",
            "ttft_p50_ms", "ttft_p90_ms", "server_ttft_p50_ms", "completion_tokens_mean", "modes", "refused",
            "num_refused", "num_out_of_scope", "oos_refused", "num_oos_refused", "prompt_tokens_mean",
            "num_flagged", "num_right_flagged", "num_oos_flagged", "num_oos_unwarned", "num_unmatched",
            "num_right_unmatched", "num_oos_unmatched"}
ANSWER_KEYS = {"part", "question", "setting", "repeat", "error", "answer", "finish_reason", "ran_to_cap", "ttft_ms",
               "server_ttft_ms", "mode", "completion_tokens", "prompt_tokens", "sources", "chunks", "scores", "right",
               "inside", "source_top", "source_any", "refused", "unsupported", "unmatched_words"}


# ---- the committed set ---------------------------------------------------------------------------


def extracted_texts(qset) -> dict[str, str]:
    """Each document's text as an upload gets it (the server's own extractors)."""
    texts = {}
    for doc in qset.documents:
        (extracted,) = extract_file(doc.path.name, doc.path.read_bytes(), ExtractionLimits.of(LimitsConfig()), doc.id)
        assert extracted.file_format.value == doc.format, doc.id
        texts[doc.id] = collapse(extracted.text)
    return texts


def assert_kept_out_and_small(qset) -> None:
    """None of the set's documents comes from what is kept for an independent check (the PDF manuals Debian
    installs here, the configuration files Redis, PostgreSQL and nginx ship); each is under 300 kB."""
    assert not any(re.search(r"tasn1|shared-mime|redis|postgres|nginx", f"{d.origin} {d.package}", re.I)
                   for d in qset.documents)
    assert all(d.path.stat().st_size < 300_000 for d in qset.documents)


def assert_for_reporting_only(qset, others: set[str], min_per_document: int) -> None:
    """A set nothing is tuned on: documents in no other set (`others`: their origins), kept out and small, every
    question in the test split, at least `min_per_document` a document, and 4 out of scope with no evidence."""
    assert not {d.origin for d in qset.documents} & others
    assert_kept_out_and_small(qset)
    assert {q.split for q in qset.questions} == {"test"} and qset.split("dev") == []
    for doc_id, counts in qset.counts().items():
        assert counts["test"] >= min_per_document, doc_id
    out_of_scope = [q for q in qset.questions if q.is_out_of_scope]
    assert len(out_of_scope) >= 4 and all(q.evidence is None for q in out_of_scope)


@pytest.mark.parametrize("path", [DEFAULT_SET, HOLDOUT_SET, HOLDOUT2_SET, CONFIG_SET],
                         ids=["set", "holdout", "holdout2", "config"])
def test_every_question_is_stated_in_its_document_as_extracted(path):
    qset = load_set(path)
    texts = extracted_texts(qset)
    for q in qset.questions:
        if q.is_out_of_scope:  # nothing states it: the right answer is a refusal, never a fact from a document
            assert q.is_right("I could not find this in the documents.") and not q.is_right(q.question), q.id
            continue
        evidence = q.evidence.search(texts[q.document])
        assert evidence, f"{q.id}: its evidence is not in {q.document}'s extracted text"
        assert q.pattern.search(evidence.group(0)), f"{q.id}: the evidence does not hold the answer"
        assert q.is_right(q.answer), f"{q.id}: the short answer does not match its own pattern"
        assert not q.is_right(q.question), f"{q.id}: echoing the question would count as right"


def test_the_set_real_documents_several_formats_and_disjoint_halves():
    qset = load_set(DEFAULT_SET)
    assert len(qset.documents) >= 6 and len(qset.questions) >= 40
    assert {"pdf", "html", "markdown", "text"} <= {d.format for d in qset.documents}
    assert_kept_out_and_small(qset)
    dev, test = ({q.id for q in qset.split(s)} for s in ("dev", "test"))
    assert dev and test and not dev & test and dev | test == {q.id for q in qset.questions}
    assert qset.split("all") == list(qset.questions)
    for doc_id, counts in qset.counts().items():
        assert counts["dev"] + counts["test"] >= 6 and counts["dev"] >= 3 and counts["test"] >= 3, doc_id
    in_scope = {q.id for q in qset.questions if not q.is_out_of_scope}
    assert abs(len(dev & in_scope) - len(test & in_scope)) <= 2  # out-of-scope ones apart: 6 more in test (stop 55)
    out_of_scope = [q for q in qset.questions if q.is_out_of_scope]
    assert len(out_of_scope) >= 14 and {q.split for q in out_of_scope} == {"dev", "test"}
    assert all(q.evidence is None for q in out_of_scope)


def test_the_holdout_set_is_another_set_of_real_documents():
    """A second set nothing is tuned on (`--set bench/data/answers_holdout/questions.json`): other documents,
    the same rules, out-of-scope questions too."""
    qset, main_set = load_set(HOLDOUT_SET), load_set(DEFAULT_SET)
    assert len(qset.documents) >= 6 and len(qset.questions) >= 40
    assert {"pdf", "html", "markdown", "text"} <= {d.format for d in qset.documents}
    assert not {d.origin for d in qset.documents} & {d.origin for d in main_set.documents}
    assert_kept_out_and_small(qset)
    for doc_id, counts in qset.counts().items():
        assert counts["dev"] >= 3 and counts["test"] >= 3, doc_id
    assert {q.split for q in qset.questions if q.is_out_of_scope} == {"dev", "test"}


def test_the_second_holdout_set_is_a_third_set_of_real_documents_all_for_reporting():
    """A third set, for reporting only (`--set bench/data/answers_holdout2/questions.json`): documents in neither
    other set, the same rules, every question in the test split, out-of-scope questions too."""
    qset = load_set(HOLDOUT2_SET)
    others = {d.origin for path in (DEFAULT_SET, HOLDOUT_SET) for d in load_set(path).documents}
    assert len(qset.documents) >= 8 and len([q for q in qset.questions if not q.is_out_of_scope]) >= 48
    formats = Counter(d.format for d in qset.documents)
    assert formats["pdf"] >= 2 and formats["html"] >= 1 and formats["markdown"] >= 1 and formats["text"] >= 2
    assert_for_reporting_only(qset, others, min_per_document=6)


def test_the_config_set_is_a_fourth_set_of_configuration_files_and_manuals_all_for_reporting():
    """A fourth set, for reporting only (`--set bench/data/answers_config/questions.json`): configuration files and
    reference manuals (entries with their comments), in none of the other sets, every question in the test split."""
    qset = load_set(CONFIG_SET)
    others = {d.origin for path in (DEFAULT_SET, HOLDOUT_SET, HOLDOUT2_SET) for d in load_set(path).documents}
    assert len(qset.documents) >= 6 and len([q for q in qset.questions if not q.is_out_of_scope]) >= 30
    assert sum(d.origin.startswith("/usr/share/man/") for d in qset.documents) >= 3
    assert sum(not d.origin.startswith("/usr/share/man/") for d in qset.documents) >= 3
    formats = Counter(d.format for d in qset.documents)
    assert formats["pdf"] >= 1 and formats["text"] >= 3
    assert_for_reporting_only(qset, others, min_per_document=4)


def test_load_set_refuses_a_broken_set(tmp_path):
    (tmp_path / "a.md").write_text("# A\nThe code is 4812.")
    doc = {"id": "a.md", "file": "a.md", "format": "markdown", "origin": "here", "package": "none"}
    question = {"id": "q", "document": "a.md", "split": "dev", "question": "Code?", "answer": "4812",
                "pattern": "4812", "evidence": "code is 4812"}

    def refused(documents, questions, match):
        path = tmp_path / "set.json"
        path.write_text(json.dumps({"documents": documents, "questions": questions}))
        with pytest.raises(ValueError, match=match):
            load_set(path)

    refused([doc], [{**question, "split": "train"}], "split 'train'")
    refused([doc], [{**question, "document": "b.md"}], "unknown documents: b.md")
    refused([doc], [{**question, "pattern": "(4812"}], "question q: bad pattern")
    refused([doc], [question, question], "repeated question ids: q")
    refused([{**doc, "file": "missing.md"}], [question], "missing.md")
    refused([doc], [{**question, "out_of_scope": True}], "out-of-scope question has no document")
    with pytest.raises(ValueError, match="not found"):
        load_set(tmp_path / "none.json")


# ---- scoring on known answers --------------------------------------------------------------------


def streamed(answer: str, sources: list[tuple[str, str]], finish_reason: str = "stop") -> StreamedAnswer:
    """An answer with sources (document id, chunk text), sent at 0 s, first token at 0.1 s."""
    done = {"mode": "blend", "finish_reason": finish_reason, "usage": {"completion_tokens": 3, "prompt_tokens": 50},
            "timings": {"ttft_ms": 90.0}}
    return StreamedAnswer(0.0, (0.1,), 0.2, answer, done,
                          tuple({"document_id": d, "chunk_id": f"{d}#{i}", "text": t} for i, (d, t) in enumerate(sources)))


def test_document_answers_are_scored_by_pattern_evidence_and_source():
    q = next(q for q in load_set(DEFAULT_SET).questions if q.id == "gzip-1")  # default level -6
    assert q.pattern.pattern and q.document == "gzip.1.pdf"
    # the fact stated across a line break and runs of spaces still counts as inside
    chunk = "biased ... The default   compression\n level is -6 (that is"
    right = score_document_answer(q, streamed("The default level is -6.", [("gzip.1.pdf", chunk)]))
    assert right == {"right": True, "inside": True, "source_top": True, "source_any": True, "refused": False,
                     "out_of_scope": False}
    wrong = score_document_answer(q, streamed("It is 9 or 16.", [("zlib-faq.txt", "16 exabytes"), ("gzip.1.pdf", "-9 --best")]))
    assert wrong == {"right": False, "inside": False, "source_top": False, "source_any": True, "refused": False,
                     "out_of_scope": False}
    assert score_document_answer(q, streamed("level 6", []))["source_any"] is False
    # a citation is not an answer: "[6]" names a chunk, not the level (nor "[1, 6]")
    assert not score_document_answer(q, streamed("The default level is 9 [6].", []))["right"]
    assert not score_document_answer(q, streamed("Level 1 [1, 6]", []))["right"]
    assert score_document_answer(q, streamed("-6 [1]", []))["right"]
    assert score_document_answer(q, streamed("I could not find this in the documents.", []))["refused"] is True


def test_out_of_scope_answers_are_right_only_when_they_refuse():
    q = next(q for q in load_set(DEFAULT_SET).questions if q.id == "oos-1")  # bzip2's level: no document says
    assert q.is_out_of_scope and q.document is None
    refusal = score_document_answer(q, streamed("I could not find this in the documents.", []))
    assert refusal == {"right": True, "inside": None, "source_top": None, "source_any": None, "refused": True,
                       "out_of_scope": True}
    for answer in ("The documents don't mention bzip2.", "The text does not say.", "I don't know."):
        assert score_document_answer(q, streamed(answer, [("gzip.1.pdf", "x")]))["right"], answer
    fabricated = score_document_answer(q, streamed("The default compression level of bzip2 is 9.", [("gzip.1.pdf", "-9")]))
    assert fabricated["right"] is False and fabricated["refused"] is False


def test_musique_answers_are_scored_by_normalized_gold():
    assert contains_gold("He studied at the Exeter College, Oxford.", ["Exeter College"])
    assert contains_gold("exeter   college", ["The Exeter College"])
    assert not contains_gold("He studied at Exeter.", ["Exeter College"])
    assert not contains_gold("anything", [""])
    scored = score_musique_answer(["Charles County"], {"m-1"}, streamed("charles county", [("m-0", "no"), ("m-1", "Charles County, MD")]))
    assert scored == {"right": True, "inside": True, "source_top": False, "source_any": True, "refused": False}
    # no passage holds the gold: no source can be right, so none is scored
    assert score_musique_answer(["x y"], set(), streamed("x y", [("m-0", "z")]))["source_top"] is None


def test_a_setting_row_on_known_records():
    def record(right, inside, top, ttft, cap=False, error=None):
        base = {"question": f"q{ttft}", "error": error}
        return base if error else {**base, "right": right, "inside": inside, "source_top": top, "source_any": top,
                                   "ran_to_cap": cap, "ttft_ms": ttft, "server_ttft_ms": ttft - 10,
                                   "completion_tokens": 4, "mode": "blend"}

    oos = [{**record(True, None, None, 5.0), "out_of_scope": True, "refused": True},
           {**record(False, None, None, 900.0), "out_of_scope": True, "refused": False},
           {**record(False, None, None, 800.0), "out_of_scope": True, "refused": False, "unsupported": ["10"]},
           {**record(False, None, None, 700.0), "out_of_scope": True, "refused": False, "unmatched_words": ["brotli"]}]
    rows = [{**record(True, True, True, 100.0), "unsupported": ["22"], "unmatched_words": ["told"]},
            {**record(False, True, None, 300.0, cap=True), "unsupported": ["x.conf"]},
            {**record(False, False, False, 200.0), "refused": True},
            record(None, None, None, 0, error="QueryFailed: queue full"), *oos]
    row = part_row(rows)
    assert set(row) == ROW_KEYS
    assert row["num_questions"] == 8 and row["num_answers"] == 3 and row["num_errors"] == 1
    # out-of-scope answers count apart: one refused of four; no in-scope rate or TTFT includes them
    assert row["num_out_of_scope"] == 4 and row["num_oos_refused"] == 1 and row["oos_refused"] == pytest.approx(1 / 4)
    # warned of an unsupported term: two in scope (one right), one out of scope; one made up and unwarned
    assert row["num_flagged"] == 2 and row["num_right_flagged"] == 1
    assert row["num_oos_flagged"] == 1 and row["num_oos_unwarned"] == 1
    # warned that no document uses a word of the question: one in scope (right), one out of scope
    assert row["num_unmatched"] == 1 and row["num_right_unmatched"] == 1 and row["num_oos_unmatched"] == 1
    assert row["num_refused"] == 1 and row["refused"] == pytest.approx(1 / 3)
    assert row["right"] == pytest.approx(1 / 3) and row["inside"] == pytest.approx(2 / 3)
    assert row["right_when_inside"] == 0.5 and row["num_source_scored"] == 2 and row["source_top"] == 0.5
    assert row["ran_to_cap"] == pytest.approx(1 / 3) and row["ttft_p50_ms"] == 200.0
    assert row["server_ttft_p50_ms"] == 190.0 and row["errors"] == ["QueryFailed: queue full"]


def test_settings_are_paired_on_the_same_questions_with_a_sign_test():
    def record(setting, question, right, answer="x", repeat=0, error=None, oos=False):
        return {"part": "docs_test", "setting": setting, "question": question, "repeat": repeat, "right": right,
                "answer": answer, "error": error, "out_of_scope": oos}

    full = [record("full", f"q{i}", i < 8) for i in range(10)] + [record("full", "oos", True, oos=True)]
    blend = ([record("default", f"q{i}", i in (0, 1, 8)) for i in range(9)]  # q9 not answered: no pair
             + [record("default", "q9", True, error="QueryFailed"), record("default", "oos", False, oos=True)])
    blend[0]["answer"] = "different"
    row = paired_row(full, blend)
    # full right alone on q2-q7 (6), blend alone on q8 (1): 7 discordant, of 9 pairs (q9 failed, oos apart)
    assert row == {"num_pairs": 9, "both_right": 2, "only_this": 6, "only_against": 1, "neither": 0,
                   "same_answer": 8, "p_value": pytest.approx(0.125)}  # 2 * (1 + 7) / 2**7
    assert paired_row(blend, blend)["p_value"] == 1.0  # no discordant pair: nothing tells them apart
    swapped = paired_row(blend, full)
    assert (swapped["only_this"], swapped["only_against"]) == (1, 6) and swapped["p_value"] == row["p_value"]
    out = paired(full + blend, [Setting("default"), Setting("full")])
    assert out == {"docs_test": {"against": "default", "settings": {"full": row}}}
    assert paired(full, [Setting("full")]) == {}  # one setting: nothing to pair


def test_settings_take_turns_and_quick_checks_spread_over_documents():
    a, b, c = (Setting(n) for n in "abc")
    assert [in_turn([a, b, c], t) for t in range(4)] == [[a, b, c], [b, c, a], [c, a, b], [a, b, c]]
    qset = load_set(DEFAULT_SET)
    picked = pick_questions(qset, "test", 10)  # the out-of-scope questions take turns as a ninth "document"
    assert len(picked) == 10 and len({q.document for q in picked}) == 9 and all(q.split == "test" for q in picked)
    assert None in {q.document for q in picked}
    assert pick_questions(qset, "dev", None) == qset.split("dev")
    with pytest.raises(ValueError, match="unknown settings nope"):
        settings_named(["default", "nope"])
    with pytest.raises(ValueError, match="named twice: full"):
        settings_named(["full", "full"])
    assert Setting("x", server={"b": 1, "a": {"c": 2}}).server_key == Setting("y", server={"a": {"c": 2}, "b": 1}).server_key
    assert deep_merge({"model": {"name": "m", "device": "cpu"}, "x": 1},
                      {"model": {"device": "cuda"}}) == {"model": {"name": "m", "device": "cuda"}, "x": 1}


# ---- end to end ----------------------------------------------------------------------------------


WORDS = ("the river flows past an old mill near the town of harlow where people trade wool and the bridge "
         "was painted red in the spring by a team of workers from the valley").split()


def tiny_set(tmp_path) -> str:
    """Two documents (Markdown, PDF; ids other than their file names) and a question on each, one per half;
    and an out-of-scope question (test half)."""
    docs = tmp_path / "set"
    docs.mkdir()
    (docs / "vault.md").write_text("# Vault\n\nThe secret code of the blue vault is 4812. The vault is in Lisbon.\n")
    (docs / "bridge.pdf").write_bytes(make_pdf([["The red bridge in Porto was painted in 1966."],
                                                ["It is 300 metres long."]], title="Bridge"))
    data = {
        "documents": [{"id": "vault", "file": "vault.md", "format": "markdown", "origin": "test", "package": "none"},
                      {"id": "bridge", "file": "bridge.pdf", "format": "pdf", "origin": "test", "package": "none"}],
        "questions": [
            {"id": "vault-1", "document": "vault", "split": "dev", "question": "What is the blue vault's code?",
             "answer": "4812", "pattern": "4812", "evidence": "blue vault is 4812"},
            {"id": "bridge-1", "document": "bridge", "split": "test", "question": "When was the red bridge painted?",
             "answer": "1966", "pattern": "1966", "evidence": "painted in 1966"},
            {"id": "oos-1", "document": None, "split": "test", "out_of_scope": True,
             "question": "What is the boiling point of ethanol?", "answer": "a refusal"}],
    }
    path = docs / "questions.json"
    path.write_text(json.dumps(data))
    return str(path)


def tiny_musique(tmp_path) -> str:
    """Two MuSiQue-shaped questions, 3 passages each; the gold answer only in each question's passage 0."""
    items = [{"question": f"where is mill number {qi}?", "answers": ["Harlow Town"],
              "ctxs": [{"title": f"t{qi}{pi}", "text": (("harlow town " if pi == 0 else "") + " ".join(WORDS[pi:])) * 2}
                       for pi in range(3)]} for qi in range(2)]
    path = tmp_path / "musique.json"
    path.write_text(json.dumps(items))
    return str(path)


def test_bench_answers_end_to_end_on_a_tiny_model(tmp_path, capsys, monkeypatch):
    # a setting with a server override: its own server, retrieving one chunk
    monkeypatch.setitem(answers_settings.SETTINGS, "top1-server", Setting("top1-server", server={"retrieval": {"top_k": 1}}))
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    out = tmp_path / "out" / "answers.json"
    code = main(["bench", "answers", "--in-process", "--config", str(config), "--set", tiny_set(tmp_path),
                 "--settings", "default,full,top1-server", "--repeats", "2", "--max-tokens", "3",
                 "--musique", "2", "--musique-data", tiny_musique(tmp_path), "--musique-passages", "3",
                 "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    assert code == 0
    summary = json.loads(lines[-1])
    assert json.loads(out.read_text()) == summary
    assert summary["bench"] == "answers" and summary["model"] == "random" and summary["repeats"] == 2
    assert [s["name"] for s in summary["settings"]] == ["default", "full", "top1-server"]
    assert summary["questions_asked"] == {"vault": {"dev": 1, "test": 0}, "bridge": {"dev": 0, "test": 1}}
    servers = summary["servers"]
    assert [s["settings"] for s in servers] == [["default", "full"], ["top1-server"]]
    assert servers[1]["overrides"] == {"retrieval": {"top_k": 1}} and servers[0]["url"] != servers[1]["url"]
    assert servers[0]["documents"]["bridge"]["num_pages"] == 2 and servers[0]["documents"]["vault"]["num_chunks"] == 1
    assert summary["musique"]["num_questions"] == 2
    # every part, every setting: a row over 2 repeats of its questions
    assert list(summary["results"]) == ["docs_test", "docs_dev", "musique"]
    for part, rows in summary["results"].items():
        assert list(rows) == ["default", "full", "top1-server"]
        for row in rows.values():
            assert set(row) == ROW_KEYS and row["num_errors"] == 0
            assert row["num_answers"] + row["num_out_of_scope"] == 2 * row["num_questions"] and row["ttft_p50_ms"] > 0
            # the server's relevance floor refuses the out-of-scope question, in every setting
            assert row["num_out_of_scope"] == (2 if part == "docs_test" else 0)
            assert row["num_oos_refused"] == row["num_out_of_scope"]
            assert row["num_refused"] == 0 or part == "musique"  # (the tiny MuSiQue passages are word salad)
    answers = summary["answers"]
    assert all(set(a) >= ANSWER_KEYS for a in answers)
    assert Counter((a["part"], a["setting"]) for a in answers) == {
        (p, s): 2 * (1 if p == "docs_dev" else 2) for p in ("docs_dev", "docs_test", "musique")
        for s in ("default", "full", "top1-server")}
    # the settings take turns: the first asked moves on by one each question, and each repeat
    docs = [a for a in answers if a["part"] != "musique"]
    assert [(a["question"], a["setting"]) for a in docs[:6]] == [
        ("vault-1", "default"), ("vault-1", "full"), ("vault-1", "top1-server"),
        ("bridge-1", "full"), ("bridge-1", "top1-server"), ("bridge-1", "default")]
    assert docs[6]["setting"] == "top1-server" and docs[9]["setting"] == "full"  # oos-1 third; the repeat's turn
    for a in answers:
        assert a["completion_tokens"] <= 3 and a["ran_to_cap"] == (a["finish_reason"] == "length")
        if a["question"] == "oos-1":  # refused by the server: no sources, no model
            assert a["right"] and a["refused"] and a["sources"] == [] and a["mode"] is None
            continue
        # (auto, the default, may plan a full prefill too; a question the floor refuses runs no prefill)
        assert a["mode"] == "full" or a["setting"] != "full" or (a["refused"] and a["mode"] is None)
        assert len(a["sources"]) <= 1 if a["setting"] == "top1-server" else len(a["sources"]) <= 3
        assert len(a["scores"]) == len(a["sources"]) and all(-1.0 <= x <= 1.0 for x in a["scores"])
        assert isinstance(a["unmatched_words"], list)  # the server's `sources` event says (documents and MuSiQue)
        expected = {"vault-1": "vault", "bridge-1": "bridge"}.get(a["question"])
        if expected:  # one small chunk per page or file: the fact's chunk in a top-3 prompt
            assert a["source_top"] == (a["sources"][0] == expected) and a["source_any"] == (expected in a["sources"])
            if a["setting"] != "top1-server":
                assert a["inside"] and a["source_any"]
            assert a["right"] == bool(re.search({"vault-1": "4812", "bridge-1": "1966"}[a["question"]], a["answer"]))
        else:  # MuSiQue: the documents were deleted first, each question's passages after it
            mi = a["question"].split("-")[1]
            assert all(s.startswith(f"musique-{mi}-") for s in a["sources"]) and a["num_gold_passages"] == 1
            assert a["source_any"] == (f"musique-{mi}-0" in a["sources"]) == a["inside"]
    # each part: the other settings paired against the first on the same questions and repeats
    assert list(summary["paired"]) == ["docs_test", "docs_dev", "musique"]
    for part, pairs in summary["paired"].items():
        assert pairs["against"] == "default" and list(pairs["settings"]) == ["full", "top1-server"]
        for pair in pairs["settings"].values():
            assert pair["num_pairs"] == summary["results"][part]["default"]["num_answers"]
            assert pair["both_right"] + pair["only_this"] + pair["only_against"] + pair["neither"] == pair["num_pairs"]
            assert 0 < pair["p_value"] <= 1
    table = "\n".join(lines[:-1])
    assert "documents, test half (2 questions)" in table and "MuSiQue (2 questions)" in table
    assert re.search(r"top1-server\s+\d/2\s+\d/2", table)
    assert re.search(r"paired against default.*\n  full +\+\d / -\d, p [01]\.\d\d; alike \d/2", table)


def test_bench_answers_bad_arguments(tmp_path, capsys):
    set_path = tiny_set(tmp_path)
    assert main(["bench", "answers", "--set", set_path, "--settings", "default,nope", "--musique", "0"]) == 2
    assert "unknown settings nope" in capsys.readouterr().err
    assert main(["bench", "answers", "--set", set_path, "--musique-data", str(tmp_path / "none.json")]) == 2
    assert "--musique 0 leaves the MuSiQue part out" in capsys.readouterr().err
    assert main(["bench", "answers", "--set", set_path, "--repeats", "0"]) == 2
    assert main(["bench", "answers", "--set", str(tmp_path / "none.json"), "--musique", "0"]) == 2
    assert "question set not found" in capsys.readouterr().err


def test_bench_answers_starts_ragblend_serve_children(tmp_path, capsys):
    """Without --in-process: `ragblend serve` children on their own data dirs, a config merged for each."""
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY_CONFIG)
    code = main(["bench", "answers", "--config", str(config), "--set", tiny_set(tmp_path), "--settings", "default",
                 "--split", "test", "--max-tokens", "2", "--musique", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    summary = json.loads(captured.out.strip().splitlines()[-1])
    assert summary["model"] == "random" and list(summary["results"]) == ["docs_test"]
    assert summary["results"]["docs_test"]["default"]["num_answers"] == 1
