"""OpenAI-compatible chat completion models, with ragblend's RAG fields and citations."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.openai_compat import StreamOptions, check_extra_fields
from app.query.protocol import CitationOut, GenerationOptions, PlanOut, SourceOut, StrictInt, TimingsOut


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="developer: OpenAI's newer name for system instructions, read as a system message.")
    content: str | list[TextPart]
    name: str | None = Field(None, description="Accepted, ignored.")

    @property
    def prompt_role(self) -> str:
        """The role in the model's prompt (its chat template knows system, user, assistant)."""
        return "system" if self.role == "developer" else self.role

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationOptions):
    """OpenAI's fields (frequency_penalty and presence_penalty in OpenAI's range, [-2, 2]) plus the RAG
    extras (collection, top_k, retrieval, mode, recompute_ratio, chunk_ids, repetition_penalty,
    no_repeat_ngram_size). An OpenAI parameter ragblend does not implement is a 400 naming it; the OpenAI
    fields real clients send that change nothing here (app/openai_compat.py IGNORED_PARAMETERS) are
    ignored; any other field is a 422, as on every route."""

    model_config = ConfigDict(extra="allow")  # checked by check_fields (a 400 or a 422 naming them)

    model: str | None = Field(None, description="The served model, or `<model>:<collection>` to pick a knowledge "
                              "base (GET /v1/models lists them).")
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt = Field(1, ge=1, description="Only one choice is generated (n > 1 is a 400).")
    stream_options: StreamOptions | None = None

    def check_fields(self) -> None:
        check_extra_fields(self.model_extra, {"n": self.n})


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # OpenAI's name for prompt tokens served from a prefix cache


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    prefix_cached_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails(cached_tokens=0)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage
    sources: list[SourceOut]
    citations: list[CitationOut] = []  # the sources the answer cites as [n] (a number naming none left out)
    timings: TimingsOut
    mode: str | None = Field(description="The prefill mode that ran; null: none (nothing relevant was retrieved).")
    recompute_ratio: float | None = None
    quality_guarded: bool = False  # the quality guard raised the recompute ratio
    plan: PlanOut | None = None  # the loading planner's choice (mode 'auto')
    unsupported: list[str] = []  # the answer's numbers and names no source, nor the question, contains
    warnings: list[str] = []


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]  # empty in the usage chunk (stream_options.include_usage)
    sources: list[SourceOut] | None = None  # on the first chunk
    citations: list[CitationOut] | None = None  # on the last chunk: the sources the answer cites as [n]
    usage: ChatUsage | None = None  # on the last chunk
    timings: TimingsOut | None = None  # on the last chunk
    recompute_ratio: float | None = None  # on the last chunk
    mode: str | None = None  # on the last chunk: the prefill mode used
    quality_guarded: bool | None = None  # on the last chunk
    plan: PlanOut | None = None  # on the last chunk
    unsupported: list[str] | None = None  # on the last chunk: the answer's numbers and names no source contains
    warnings: list[str] | None = None  # on the first chunk: retrieval's; on the last: the answer's (unsupported)
