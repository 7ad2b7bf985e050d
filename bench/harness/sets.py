"""The question sets of `ragblend bench answers` (bench/data/*/questions.json) and their scoring: real documents,
questions with a `pattern` for a right answer and an `evidence` pattern for the passage stating it, matched
case-insensitively on white-space-collapsed text; out-of-scope questions, right when refused
(docs/benchmarks/answers.md#the-question-set)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Sequence

from bench.harness.fidelity import normalize_answer

DEFAULT_SET = Path(__file__).resolve().parents[1] / "data" / "answers" / "questions.json"
# a second set of other documents, for an independent check: nothing is tuned on it (docs/benchmarks/answers.md)
HOLDOUT_SET = Path(__file__).resolve().parents[1] / "data" / "answers_holdout" / "questions.json"
# a third set of other documents, for reporting only: nothing is tuned on it, every question is in the test split
HOLDOUT2_SET = Path(__file__).resolve().parents[1] / "data" / "answers_holdout2" / "questions.json"
# a fourth set, of configuration files and reference manuals (entries with their comments), for reporting only:
# nothing is tuned on it, every question is in the test split
CONFIG_SET = Path(__file__).resolve().parents[1] / "data" / "answers_config" / "questions.json"
# An answer saying the documents do not hold it: the server's fixed not-found answer, or a model's own.
REFUSAL = re.compile(
    r"could ?n[o']t find|can ?n[o']t find|cannot find|unable to (?:find|answer)|can ?n[o']t answer|cannot answer"
    r"|not (?:found|mentioned|stated|given|provided|specified|covered|included|available) in"
    r"|no (?:information|mention|answer) (?:about|on|of|to|in|for)"
    r"|(?:documents?|text|context) (?:does|do) ?n[o']t (?:say|mention|contain|state|provide|specify|include)"
    r"|do ?n[o']t know", re.IGNORECASE)
# An answer's citation of a chunk ("[2]", "[1, 3]"): taken out before its pattern is matched, so that a
# question whose answer is a small number is not answered by citing the chunk of that number.
CITATION = re.compile(r"\[\d+(?:\s*,\s*\d+)*\]")
SPLITS = ("dev", "test")
Split = Literal["dev", "test"]


@dataclass(frozen=True)
class SetDocument:
    id: str  # the document id the bench uploads it under (the form's `ids`)
    path: Path
    format: str
    origin: str  # where it came from on a Debian system
    package: str


@dataclass(frozen=True)
class SetQuestion:
    id: str
    document: str | None  # None: out of scope (no document states it)
    split: Split
    question: str
    answer: str  # the short answer, for people reading the results
    pattern: re.Pattern[str]  # matches a right answer
    evidence: re.Pattern[str] | None  # matches the passage that states it (None: out of scope)

    @property
    def is_out_of_scope(self) -> bool:
        return self.document is None

    def is_right(self, answer: str) -> bool:
        return self.pattern.search(collapse(CITATION.sub(" ", answer))) is not None

    def is_inside(self, texts: Iterable[str]) -> bool | None:
        """Whether one of the retrieved chunks' texts states the answer (None: out of scope, none can)."""
        if self.evidence is None:
            return None
        return any(self.evidence.search(collapse(text)) for text in texts)


@dataclass(frozen=True)
class QuestionSet:
    path: Path
    documents: tuple[SetDocument, ...]
    questions: tuple[SetQuestion, ...]

    def split(self, which: str) -> list[SetQuestion]:
        """'dev', 'test' or 'all' (both, in the file's order)."""
        return [q for q in self.questions if which == "all" or q.split == which]

    def counts(self) -> dict[str, dict[str, int]]:
        """Questions per document and split."""
        out = {d.id: {s: 0 for s in SPLITS} for d in self.documents}
        for q in self.questions:
            if q.document is not None:
                out[q.document][q.split] += 1
        return out


def collapse(text: str) -> str:
    return " ".join(text.split())


def load_set(path: Path | str = DEFAULT_SET) -> QuestionSet:
    """The set at `path`; ValueError naming what is wrong (a missing file, an unknown document, a bad
    pattern, a repeated id, a split other than dev/test)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"question set not found: {path}")
    data = json.loads(path.read_text())
    documents = tuple(SetDocument(d["id"], path.parent / d["file"], d["format"], d["origin"], d["package"])
                      for d in data["documents"])
    doc_ids = [d.id for d in documents]
    _check_unique("document ids", doc_ids)
    missing = [str(d.path) for d in documents if not d.path.is_file()]
    if missing:
        raise ValueError(f"{path}: document files missing: {', '.join(missing)}")
    questions = tuple(_question(q, path) for q in data["questions"])
    _check_unique("question ids", [q.id for q in questions])
    unknown = sorted({q.document for q in questions if q.document is not None} - set(doc_ids))
    if unknown:
        raise ValueError(f"{path}: questions name unknown documents: {', '.join(unknown)}")
    return QuestionSet(path, documents, questions)


def _question(item: dict, path: Path) -> SetQuestion:
    if item["split"] not in SPLITS:
        raise ValueError(f"{path}: question {item['id']}: split {item['split']!r} is not dev or test")
    if item.get("out_of_scope"):
        if item.get("document") is not None or item.get("evidence") is not None:
            raise ValueError(f"{path}: question {item['id']}: an out-of-scope question has no document or evidence")
        try:
            pattern = re.compile(item["pattern"], re.IGNORECASE) if item.get("pattern") else REFUSAL
        except re.error as exc:
            raise ValueError(f"{path}: question {item['id']}: bad pattern: {exc}") from None
        return SetQuestion(item["id"], None, item["split"], item["question"], item["answer"], pattern, None)
    try:
        pattern, evidence = (re.compile(item[key], re.IGNORECASE) for key in ("pattern", "evidence"))
    except re.error as exc:
        raise ValueError(f"{path}: question {item['id']}: bad pattern: {exc}") from None
    return SetQuestion(item["id"], item["document"], item["split"], item["question"], item["answer"], pattern, evidence)


def _check_unique(what: str, values: Sequence[str]) -> None:
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"repeated {what}: {', '.join(repeated)}")


# ---- MuSiQue: gold answers, normalized ----------------------------------------------------------


def contains_gold(text: str, golds: Sequence[str]) -> bool:
    """Whether `text` holds one of `golds` as a run of words, both normalized (lower case, no
    punctuation or articles: SQuAD's normalization)."""
    words = normalize_answer(text)
    for gold in golds:
        target = normalize_answer(gold)
        if target and any(words[i:i + len(target)] == target for i in range(len(words) - len(target) + 1)):
            return True
    return False
