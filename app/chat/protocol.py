"""OpenAI-compatible chat completion models, with ragblend's RAG fields and citations."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.query.protocol import GenerationOptions, PlanOut, SourceOut, TimingsOut


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(GenerationOptions):
    """OpenAI's fields plus the RAG extras (top_k, mode, recompute_ratio, chunk_ids). Unknown OpenAI
    fields (user, logprobs, ...) are ignored, as OpenAI-compatible servers do."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    stop: str | list[str] | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=1, description="Only one choice is generated.")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    reused_tokens: int
    recomputed_tokens: int


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage
    sources: list[SourceOut]
    timings: TimingsOut
    mode: str
    recompute_ratio: float | None = None
    quality_guarded: bool = False  # the quality guard raised the recompute ratio
    plan: PlanOut | None = None  # the loading planner's choice (mode 'auto')
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
    choices: list[ChunkChoice]
    sources: list[SourceOut] | None = None  # on the first chunk
    usage: ChatUsage | None = None  # on the last chunk
    timings: TimingsOut | None = None  # on the last chunk
    recompute_ratio: float | None = None  # on the last chunk
    quality_guarded: bool | None = None  # on the last chunk
    plan: PlanOut | None = None  # on the last chunk
    warnings: list[str] | None = None
