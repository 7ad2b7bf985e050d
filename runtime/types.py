"""The runtime's typed inputs and outputs: what a request asks the engine to prefill, and what a
generation emits (text pieces, then one DoneEvent with its usage and timings)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from blend_engine.types import FinishReason, PrefillMode, SamplingParams, SelectionKind
from configs.enums import RequestMode
from runtime.planning import PlanReport

RecomputeRatio = float | Literal["auto", "adaptive"] | None


@dataclass(frozen=True)
class PromptChunk:
    """A retrieved chunk as the prompt holds it: its tokens and its stored KV's key (None: none stored)."""

    token_ids: tuple[int, ...]
    kv_key: str | None


@dataclass(frozen=True)
class PrefillRequest:
    question: str
    chunks: tuple[PromptChunk, ...]
    mode: RequestMode
    sampling: SamplingParams
    recompute_ratio: RecomputeRatio = None  # None: the configured ratio
    selection: SelectionKind | None = None  # None: the configured selection
    history: tuple[dict[str, str], ...] = ()  # earlier chat messages
    namespace: str = ""  # the request's isolation key: the prefix cache never serves one namespace another's prompts
    is_prefix_cache_used: bool = True  # False: the prefix cache is neither read nor filled (benchmarks of prefills)
    # the prefix cache's epoch when the chunks were chosen (None: when its prefill begins): a prompt whose
    # document changes after it is not kept
    prefix_cache_epoch: int | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    completion_tokens: int = 0
    prefix_cached_tokens: int = 0  # prompt tokens served from the prefix cache (neither reused chunk KV nor recomputed)


@dataclass
class Timings:
    retrieval_ms: float = 0.0
    queue_ms: float = 0.0  # submitted -> its prefill starts (the prefills ahead of it, at most one step)
    background_ms: float = 0.0  # background work run before its first token (one unit at most)
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
    mode: PrefillMode | None  # None: nothing was prefilled (a fixed answer: nothing relevant was retrieved)
    recompute_ratio: float | None = None
    is_guarded: bool = False  # the quality guard raised the ratio
    plan: PlanReport | None = None  # the loading planner's choice (mode 'auto' or ratio 'auto')


GenerationEvent = TokenEvent | DoneEvent
