"""The MuSiQue dev subset (CacheBlend's evaluation set): questions, passages, gold answers."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA = "../shared/data/musique_dev.json"  # where the prompts of most benches come from


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]
    passages: tuple[str, ...]


def load_questions(path: Path | str, num_questions: int, num_passages: int, first: int = 0) -> list[Question]:
    """Questions `first` to `first + num_questions` of the data set, each with its first `num_passages`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset not found: {path}")
    items = json.loads(path.read_text())
    if num_questions < 1 or num_passages < 1:
        raise ValueError("--questions and --passages must be >= 1")
    out = []
    for item in items[first:first + num_questions]:
        passages = tuple(_passage_text(c) for c in item["ctxs"][:num_passages])
        out.append(Question(item["question"], tuple(item["answers"]), passages))
    return out


def _passage_text(ctx: dict) -> str:
    title = (ctx.get("title") or "").strip()
    return f"{title}\n{ctx['text']}" if title else ctx["text"]
