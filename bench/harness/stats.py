"""The statistics every bench quotes: medians and means that tolerate no values, percentiles, ratios with
their spread over rounds, and the turn order that lets noise hit every side alike."""

from __future__ import annotations

import time
from statistics import median
from typing import Any, Callable, Iterable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def safe_median(values: Iterable[float]) -> float | None:
    values = list(values)
    return median(values) if values else None


def safe_mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def percentiles(samples_ms: Sequence[float], qs: Sequence[float] = (50, 99)) -> dict[str, float]:
    """{"n", "p50_ms", "p99_ms", ...} of latency samples in milliseconds."""
    return {"n": len(samples_ms), **{f"p{q:g}_ms": percentile(samples_ms, q) for q in qs}}


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def spread(values: Sequence[float | None]) -> dict[str, Any]:
    """Per-round values (None where a round had none) with their median, min-max and IQR."""
    known = [v for v in values if v is not None]
    return {"values": list(values), "median": median(known) if known else None,
            "min": min(known, default=None), "max": max(known, default=None),
            "p25": percentile(known, 25), "p75": percentile(known, 75)}


def in_turn(sides: Sequence[T], turn: int) -> list[T]:
    """The sides starting from the `turn`th (mod their number): each takes every place in turn, so none
    always runs right after another (with two sides: alternating who goes first)."""
    k = turn % len(sides) if sides else 0
    return [*sides[k:], *sides[:k]]


def timed_ms(fn: Callable[[], object]) -> float:
    """Milliseconds of one call of `fn`."""
    return mean_ms(fn, 1)


def mean_ms(step: Callable[[], object], num_steps: int) -> float:
    """Milliseconds per call of `step`, over `num_steps` calls in a row."""
    start = time.perf_counter()
    for _ in range(num_steps):
        step()
    return (time.perf_counter() - start) * 1000 / num_steps
