"""OpenAI-compatible chat completion models, with ragblend's RAG fields and citations."""

from __future__ import annotations

from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from app.query.protocol import GenerationOptions, PlanOut, SourceOut, StrictInt, TimingsOut


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {}


# OpenAI parameters ragblend does not implement, each with what counts as not asking for it. A request
# that asks for one gets a 400 naming it (as vLLM does) rather than an answer that silently ignores it.
UNSUPPORTED_PARAMETERS: dict[str, Callable[[Any], bool]] = {
    "tools": _is_unset,
    "functions": _is_unset,
    "tool_choice": lambda value: value in (None, "none"),
    "function_call": lambda value: value in (None, "none"),
    "logprobs": _is_unset,
    "top_logprobs": _is_unset,
    "logit_bias": _is_unset,
    "response_format": lambda value: value is None or value == {"type": "text"},
    "presence_penalty": _is_unset,
    "frequency_penalty": _is_unset,
    "audio": _is_unset,
    "modalities": lambda value: value is None or value == ["text"],
    "prediction": _is_unset,
    "web_search_options": _is_unset,
    "n": lambda value: value in (None, 1),
}


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
    """OpenAI's fields plus the RAG extras (top_k, retrieval, mode, recompute_ratio, chunk_ids). Other fields
    (user, metadata, ...) are ignored, as OpenAI-compatible servers do, except the OpenAI parameters
    ragblend does not implement (UNSUPPORTED_PARAMETERS): asking for one is a 400 naming it."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    stop: str | list[str] | None = None
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    n: StrictInt = Field(1, ge=1, description="Only one choice is generated (n > 1 is a 400).")

    def unsupported_parameters(self) -> list[str]:
        """The unsupported OpenAI parameters this request asks for."""
        given = {"n": self.n, **(self.model_extra or {})}
        return [name for name, is_unasked in UNSUPPORTED_PARAMETERS.items()
                if name in given and not is_unasked(given[name])]


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
    mode: str | None = Field(description="The prefill mode that ran; null: none (nothing relevant was retrieved).")
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
    mode: str | None = None  # on the last chunk: the prefill mode used
    quality_guarded: bool | None = None  # on the last chunk
    plan: PlanOut | None = None  # on the last chunk
    warnings: list[str] | None = None
