"""Typed inputs and outputs of a RAG answer, shared by /v1/query and /v1/chat/completions."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

from blend_engine.types import FinishReason, SamplingParams, SelectionKind
from configs.enums import RequestMode, RetrievalMode
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
    retrieval: RetrievalMode = RetrievalConfig.mode
    chunk_ids: tuple[str, ...] | None = None  # skip retrieval: exactly these chunks, in this order
    recompute_ratio: RecomputeRatio = None  # None: the configured ratio
    selection: SelectionKind | None = None  # None: the configured selection
    history: tuple[dict[str, str], ...] = ()  # earlier chat messages
    collections: tuple[str, ...] = (DEFAULT_COLLECTION,)  # searched, and the only ones chunk_ids may name
    is_prefix_cache_used: bool = True  # read and fill the prefix cache


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
    prefix_cache_epoch: int | None = None  # the prefix cache's epoch before the chunks were chosen
    namespace: str = ""  # the prefix cache's: the request's collections' KV salts (a prompt kept for one set of
    # collections serves that set only, as their chunks' KV is theirs)
    is_nothing_relevant: bool = False  # no chunk passed the relevance floor, or a name is unmentioned: no prompt
    unmentioned_names: tuple[str, ...] = ()  # what the question names that no searched chunk mentions
    asked: tuple[str, ...] = ()  # the question and the chat's earlier messages: an answer may repeat what they say
    is_support_checked: bool = False  # retrieval.flag_unsupported_terms: app/rag/grounding.py
    unmatched_words: tuple[str, ...] = ()  # the question's words no searched chunk holds: retrieval.flag_unmatched_words

    @property
    def warnings(self) -> list[str]:
        out = []
        if self.unmentioned_names:
            out.append("no document in the searched collections mentions "
                       + ", ".join(f"'{name}'" for name in self.unmentioned_names) + ": answered as not found")
        if self.dropped_chunk_ids:
            out.append(f"dropped {len(self.dropped_chunk_ids)} lowest-ranked chunk(s) to fit the model's context: "
                       + ", ".join(self.dropped_chunk_ids))
        if self.unmatched_words:
            out.append("no document in the searched collections uses the question's word(s) "
                       + ", ".join(f"'{word}'" for word in self.unmatched_words)
                       + ": they may not cover what was asked; check the answer against the sources")
        return out


class AnswerStream(Protocol):
    """What an answer emits: TokenEvents, then one DoneEvent (a generation's JobStream, or a FixedAnswer)."""

    def __aiter__(self) -> AsyncIterator[GenerationEvent]: ...

    def cancel(self) -> None: ...


class FixedAnswer:
    """The stream of a fixed text, answered without the model (no prefill, no tokens): what a question
    gets when nothing stored is relevant to it."""

    def __init__(self, text: str, retrieval_ms: float, t_start: float):
        self.text, self.retrieval_ms, self.t_start = text, retrieval_ms, t_start

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[GenerationEvent]:
        elapsed_ms = (time.perf_counter() - self.t_start) * 1000
        yield TokenEvent(self.text)
        yield DoneEvent(Usage(), Timings(retrieval_ms=self.retrieval_ms, ttft_ms=elapsed_ms, total_ms=elapsed_ms),
                        FinishReason.STOP, None)

    def cancel(self) -> None:
        pass  # nothing runs
