"""Request and response models of /v1/query."""

from __future__ import annotations

from collections import Counter
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, field_validator
from pydantic_core import PydanticCustomError

from app.collections.names import name_problem
from app.text import NUL_MESSAGE, nul_location
from blend_engine.types import PrefillMode, SelectionKind
from configs.enums import RepetitionScope, RequestMode, RetrievalMode
from retrieval.store_types import COLLECTION_NAME_PATTERN

Ratio = float
# Strict numbers: JSON "3" or true is not an int (no coercion); an int is still a valid float.
StrictInt = Annotated[int, Strict()]
StrictFloat = Annotated[float, Strict()]
CollectionName = Annotated[str, Field(pattern=COLLECTION_NAME_PATTERN)]


class GenerationOptions(BaseModel):
    """Retrieval, prefill and sampling options shared by /v1/query and /v1/chat/completions."""

    @property
    def stop_strings(self) -> tuple[str, ...] | None:
        """The request's stop strings (None: it gave none, the configured ones apply)."""
        return (self.stop,) if isinstance(self.stop, str) else None if self.stop is None else tuple(self.stop)

    collection: CollectionName | list[CollectionName] | None = Field(
        None, description="The collection(s) (knowledge bases) to retrieve from, one name or a list; default: "
        "`default` (a scoped key: all of its own).")
    top_k: StrictInt | None = Field(None, ge=1, description="Chunks to retrieve (limit: limits.max_top_k).")
    retrieval: RetrievalMode | None = Field(
        None, description="How chunks are ranked: dense (embeddings), lexical (full-text index) or hybrid (both, "
        "fused by reciprocal rank); default from config (retrieval.mode).",
    )
    chunk_ids: list[str] | None = Field(
        None, min_length=1, description="Skip retrieval: use exactly these chunks, in this order."
    )
    mode: RequestMode | None = Field(
        None, description="auto (the loading planner picks full, blend, mixed or split) or a prefill mode; default from "
        "config (auto).",
    )
    recompute_ratio: StrictFloat | Literal["auto", "adaptive"] | None = Field(
        None, description="Share of reused tokens recomputed in blend mode, in [0, 1]; 'auto' (loading "
        "planner: what the loads hide) or 'adaptive' (as many as hold blend.adaptive_mass of the ranking score).",
    )
    selection: SelectionKind | None = Field(
        None, description="How blend ranks the cached tokens it recomputes; default from config."
    )
    max_tokens: StrictInt | None = Field(None, ge=1, description="Answer length cap (limit: limits.max_tokens).")
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = Field(
        None, description="Stop strings: the answer ends before the first of them; default from config "
        "(generation.stop); [] for none.",
    )
    frequency_penalty: StrictFloat | None = Field(
        None, ge=-2.0, le=2.0, description="OpenAI's: each token's logit lowered by this times the times it was "
        "generated so far, in [-2, 2]; default from config (generation.frequency_penalty).",
    )
    presence_penalty: StrictFloat | None = Field(
        None, ge=-2.0, le=2.0, description="OpenAI's: each token generated so far has its logit lowered by this, "
        "once, in [-2, 2]; default from config (generation.presence_penalty).",
    )
    repetition_penalty: StrictFloat | None = Field(
        None, gt=0.0, le=2.0, description="CTRL's (Hugging Face's): a seen token's positive logit divided by this, "
        "a negative one multiplied, in (0, 2] (1: off); default from config (generation.repetition_penalty).",
    )
    repetition_scope: RepetitionScope | None = Field(
        None, description="The tokens repetition_penalty covers: answer or prompt_and_answer; default from config.",
    )
    no_repeat_ngram_size: StrictInt | None = Field(
        None, ge=0, le=32, description="No n-gram of this many tokens twice in the answer (0: off); default from "
        "config (generation.no_repeat_ngram_size).",
    )
    ignore_eos: StrictBool = Field(
        False, description="Generate max_tokens tokens, past the model's end of sequence (as vLLM's "
        "ignore_eos: for benchmarks that need answers of one length); the configured stop strings are left out "
        "too (a request's own stop still applies).",
    )
    prefix_cache: StrictBool = Field(
        True, description="Reuse the longest prefix of this prompt kept from earlier answers (store.prefix_cache_bytes) "
        "and keep this one; false: neither (benchmarks that measure a prefill).",
    )
    stream: StrictBool = False

    @property
    def collections(self) -> list[str] | None:
        """The collections named, as a list (None: none named)."""
        if self.collection is None:
            return None
        return [self.collection] if isinstance(self.collection, str) else list(self.collection)

    @field_validator("collection", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        """Each name checked as a model name's collection is (app/collections/names.py): one error naming
        it, not one per branch of the union. Anything but a name or a list goes on to the type checks."""
        for name in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
            problem = name_problem(name) if isinstance(name, str) else None
            if problem is not None:  # the message as context: a name's braces are no template
                raise PydanticCustomError("collection_name", "{problem}", {"problem": problem})
        return value

    @field_validator("collection")
    @classmethod
    def _some(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and not 1 <= len(value) <= 100:
            raise ValueError("name 1 to 100 collections")
        return value

    @field_validator("chunk_ids")
    @classmethod
    def _unique(cls, value: list[str] | None) -> list[str] | None:
        where = nul_location(value, "chunk_ids")
        if where is not None:  # no chunk id holds one; Postgres could not even look it up
            raise ValueError(f"{where} {NUL_MESSAGE}")
        repeated = sorted(chunk_id for chunk_id, count in Counter(value or ()).items() if count > 1)
        if repeated:
            raise ValueError(f"chunk_ids repeat: {', '.join(repeated[:10])}")
        return value


class QueryRequest(GenerationOptions):
    model_config = ConfigDict(extra="forbid")

    question: str = Field(..., min_length=1)


class SourceOut(BaseModel):
    chunk_id: str
    document_id: str
    collection: str
    title: str | None
    score: float | None = Field(description="Cosine similarity of the chunk to the question (whatever ranked it); "
                                "null for a chunk named in chunk_ids.")
    text: str
    pages: list[int] | None = Field(None, description="Uploaded PDFs: [first, last] page the chunk's text is on.")


class CitationOut(BaseModel):
    """A [n] of the answer that names a source: the n-th chunk of the prompt (sources[n - 1])."""

    number: int = Field(description="The n of [n] in the answer (1 = the first source).")
    chunk_id: str
    document_id: str
    title: str | None
    pages: list[int] | None = Field(None, description="Uploaded PDFs: [first, last] page the chunk's text is on.")


class UsageOut(BaseModel):
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    completion_tokens: int
    prefix_cached_tokens: int = Field(0, description="Prompt tokens whose KV the prefix cache served as it was "
                                      "(a prompt seen before): neither reused chunk KV nor recomputed.")


class TimingsOut(BaseModel):
    retrieval_ms: float
    queue_ms: float = Field(0.0, description="Waiting for the engine: from the request's submission to its prefill's start.")
    background_ms: float = Field(0.0, description="Background work (an upload's precompute, KV repair) the engine ran "
                                 "before this answer's first token: one unit at most.")
    kv_load_ms: float
    prefill_ms: float
    ttft_ms: float
    total_ms: float


class PlanOut(BaseModel):
    """The loading planner's choice for this answer (mode 'auto' or recompute_ratio 'auto'), in ms."""

    plan: Literal["full", "blend", "mixed", "split", "prefix_cache"]
    recompute_ratio: float | None
    num_chunks_recomputed: int = Field(description="Stored chunks computed as fresh tokens (mixed and split plans).")
    predicted_load_ms: float
    predicted_compute_ms: float
    predicted_ttft_ms: float
    actual_load_ms: float
    actual_prefill_ms: float


class QueryResponse(BaseModel):
    answer: str
    mode: PrefillMode | None = Field(description="The prefill mode that ran; null: none ran (nothing relevant was "
                                     "retrieved: the answer is retrieval.not_found_answer, with no sources).")
    finish_reason: str | None
    recompute_ratio: float | None = None
    quality_guarded: bool = Field(False, description="The quality guard raised this answer's recompute ratio.")
    plan: PlanOut | None = None
    sources: list[SourceOut]
    citations: list[CitationOut] = Field(
        [], description="Each source the answer cites as [n], in the order first cited; a number naming no source "
        "is left out.")
    usage: UsageOut
    timings: TimingsOut
    unsupported: list[str] = Field(
        [], description="The answer's numbers and names that none of its sources, nor the question, contains "
        "(retrieval.flag_unsupported_terms); `warnings` then says so.")
    unmatched_words: list[str] = Field(
        [], description="The question's words (stop words left out) that no chunk of the searched collections holds "
        "(retrieval.flag_unmatched_words): the documents may not cover what was asked; `warnings` then says so.")
    warnings: list[str] = []
