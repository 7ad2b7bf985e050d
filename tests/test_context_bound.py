"""`ragblend bench context-bound`: which chunks each arrangement hands the model (hand-made chunks, every
choice known), its counting, and the command end to end on a tiny random model over the committed set."""

from __future__ import annotations

import json
import re

from app.cli import main
from app.commands.exit_codes import ExitCode
from bench.harness.sets import SetQuestion
from bench.answers.context_bound import ARRANGEMENTS, arranged, stating, summarize
from retrieval.store_types import StoredChunk


def chunk(name: str, text: str) -> StoredChunk:
    return StoredChunk(row_id=0, id=name, document_id="doc", position=0, text=text, token_ids=(1, 2), kv_key=None)


QUESTION = SetQuestion(id="q", document="doc", split="test", question="What is the port?", answer="8080",
                       pattern=re.compile("8080"), evidence=re.compile(r"port is 8080"))
NOISE, OTHER = chunk("noise", "nothing here"), chunk("other", "the host is example.org")
HOLDER, UNRETRIEVED = chunk("holder", "The port is 8080."), chunk("unretrieved", "Its port is 8080 too.")


def chunks_of(prompted) -> dict[str, tuple[str, ...] | None]:
    return {p.arrangement: None if p.chunks is None else tuple(c.id for c in p.chunks) for p in prompted}


def test_each_arrangement_hands_its_chunks():
    got = chunks_of(arranged(QUESTION, [NOISE, HOLDER, OTHER], [UNRETRIEVED, HOLDER], ARRANGEMENTS))
    assert got == {"retrieved": ("noise", "holder", "other"), "first": ("noise",), "answer": ("holder",),
                   "stored": ("unretrieved",)}  # the document's first chunk stating it, retrieved or not


def test_answer_falls_back_to_what_was_retrieved_and_a_refusal_asks_nothing():
    got = chunks_of(arranged(QUESTION, [NOISE, OTHER], [HOLDER], ARRANGEMENTS))
    assert got["answer"] == ("noise", "other") and got["stored"] == ("holder",)
    refused = chunks_of(arranged(QUESTION, None, [HOLDER], ARRANGEMENTS))
    assert refused == {"retrieved": None, "first": None, "answer": None, "stored": ("holder",)}
    nowhere = chunks_of(arranged(QUESTION, [NOISE], [NOISE, OTHER], ("stored",)))
    assert nowhere == {"stored": None}
    assert stating(QUESTION, [NOISE, OTHER]) is None


def test_summary_counts_right_asked_and_any():
    rows = [{"inside": True, "arrangements": {"retrieved": {"answer": "8080", "right": True, "prompt_tokens": 30},
                                              "first": {"answer": "80", "right": False, "prompt_tokens": 10}}},
            {"inside": False, "arrangements": {"retrieved": {"answer": None, "right": False},
                                               "first": {"answer": "x", "right": False, "prompt_tokens": 20}}},
            {"inside": True, "arrangements": {"retrieved": {"answer": "no", "right": False, "prompt_tokens": 50},
                                              "first": {"answer": "8080", "right": True, "prompt_tokens": 12}}}]
    summary = summarize(rows, ["retrieved", "first"])
    assert summary["retrieved"] == {"right": 1, "asked": 2, "prompt_tokens_mean": 40}
    assert summary["first"] == {"right": 1, "asked": 3, "prompt_tokens_mean": 14}
    assert summary["right_in_any"] == 2 and summary["inside"] == 2


def test_command_end_to_end_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "bound.json"
    code = main(["bench", "context-bound", "--model", "random:tiny-llama", "--limit", "2",
                 "--arrangements", "retrieved,stored", "--out", str(out)])
    assert code == ExitCode.OK
    result = json.loads(out.read_text())
    assert result["bench"] == "context-bound" and result["num_questions"] == 2
    assert set(result["summary"]) == {"retrieved", "stored", "right_in_any", "inside"}
    for row in result["questions"]:
        stored = row["arrangements"]["stored"]
        assert stored["answer"] is not None and len(stored["chunks"]) == 1  # each question's document states it
        retrieved = row["arrangements"]["retrieved"]
        assert retrieved["chunks"] == row["retrieved_chunks"] and retrieved["prompt_tokens"] > stored["prompt_tokens"]
    assert "any of them" in capsys.readouterr().out


def test_unknown_arrangement_is_a_usage_error(capsys):
    assert main(["bench", "context-bound", "--arrangements", "retrieved,best"]) == ExitCode.USAGE
    assert "unknown arrangement" in capsys.readouterr().err
