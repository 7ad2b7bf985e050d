"""Fidelity metrics shared by the benchmarks: token F1 (SQuAD-style) against an answer, next-token KL and
argmax agreement against a reference's logits."""

from __future__ import annotations

import re
import string
from collections import Counter
from typing import Sequence

import torch


def normalize_answer(text: str) -> list[str]:
    """Lower-case, drop punctuation and articles, split on white space (SQuAD's normalisation)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return text.split()


def token_f1(prediction: str, reference: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def best_f1(prediction: str, references: Sequence[str]) -> float:
    return max((token_f1(prediction, r) for r in references), default=0.0)


def mean_kl(reference_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over positions of KL(reference || other); logits [T, vocab]."""
    ref = torch.log_softmax(reference_logits.float(), dim=-1)
    other = torch.log_softmax(logits.float(), dim=-1)
    return float((ref.exp() * (ref - other)).sum(-1).mean())


def argmax_agreement(logits: torch.Tensor, target_ids: Sequence[int]) -> float:
    """Share of positions whose argmax is the target token; logits [T, vocab]."""
    if not target_ids:
        return 1.0
    return float((logits.argmax(-1) == torch.tensor(list(target_ids), device=logits.device)).float().mean())
