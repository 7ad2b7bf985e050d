"""Typed inputs and outputs of a RAG answer, shared by /v1/query and /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from app.rag.planning import PlanReport
from blend_engine.types import FinishReason, PrefillMode, SamplingParams, SelectionKind
from configs.settings import RequestMode

RecomputeRatio = float | Literal["auto", "adaptive"] | None


@dataclass(frozen=True)
class RagRequest:
    question: str
    mode: RequestMode
    sampling: SamplingParams
    top_k: int = 5
    chunk_ids: tuple[str, ...] | None = None  # skip retrieval: exactly these chunks, in this order
    recompute_ratio: RecomputeRatio = None  # None: the configured ratio
    selection: SelectionKind | None = None  # None: the configured selection
    history: tuple[dict[str, str], ...] = ()  # earlier chat messages


@dataclass(frozen=True)
class Source:
    chunk_id: str
    document_id: str
    title: str | None
    score: float | None
    text: str
    token_ids: tuple[int, ...]
    kv_key: str | None
    pages: tuple[int, int] | None = None  # PDFs: first and last page


@dataclass(frozen=True)
class RagContext:
    """The chunks a prompt will hold, after fitting the model's context."""

    sources: list[Source]
    dropped_chunk_ids: list[str]
    retrieval_ms: float

    @property
    def warnings(self) -> list[str]:
        if not self.dropped_chunk_ids:
            return []
        return [f"dropped {len(self.dropped_chunk_ids)} lowest-ranked chunk(s) to fit the model's context: "
                + ", ".join(self.dropped_chunk_ids)]


@dataclass
class Usage:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Timings:
    retrieval_ms: float = 0.0
    kv_load_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


@dataclass(frozen=True)
class TokenEvent:
    text: str


@dataclass(frozen=True)
class DoneEvent:
    usage: Usage
    timings: Timings
    finish_reason: FinishReason
    mode: PrefillMode
    recompute_ratio: float | None = None
    is_guarded: bool = False  # the quality guard raised the ratio
    kv_tiers: dict[str, int] = field(default_factory=dict)
    plan: PlanReport | None = None  # the loading planner's choice (mode 'auto' or ratio 'auto')


GenerationEvent = TokenEvent | DoneEvent
