"""Typed inputs and outputs of a RAG answer, shared by /v1/query and /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass

from blend_engine.types import SamplingParams, SelectionKind
from configs.enums import RequestMode
from retrieval.config import RetrievalConfig
from retrieval.store_types import DEFAULT_COLLECTION
from runtime.types import (  # noqa: F401 (the events are the runtime's; re-exported for app/)
    DoneEvent, GenerationEvent, PromptChunk, RecomputeRatio, Timings, TokenEvent, Usage,
)


@dataclass(frozen=True)
class RagRequest:
    question: str
    mode: RequestMode
    sampling: SamplingParams
    top_k: int = RetrievalConfig.top_k
    chunk_ids: tuple[str, ...] | None = None  # skip retrieval: exactly these chunks, in this order
    recompute_ratio: RecomputeRatio = None  # None: the configured ratio
    selection: SelectionKind | None = None  # None: the configured selection
    history: tuple[dict[str, str], ...] = ()  # earlier chat messages
    collections: tuple[str, ...] = (DEFAULT_COLLECTION,)  # searched, and the only ones chunk_ids may name


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
    collection: str = DEFAULT_COLLECTION


@dataclass(frozen=True)
class RagContext:
    """The chunks a prompt will hold, after fitting the model's context."""

    sources: list[Source]
    dropped_chunk_ids: list[str]
    retrieval_ms: float
    num_prompt_tokens: int = 0  # the prompt's length with these sources (counted when fitting it)

    @property
    def warnings(self) -> list[str]:
        if not self.dropped_chunk_ids:
            return []
        return [f"dropped {len(self.dropped_chunk_ids)} lowest-ranked chunk(s) to fit the model's context: "
                + ", ".join(self.dropped_chunk_ids)]
