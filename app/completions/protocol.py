"""OpenAI's legacy completion models (what LlamaIndex's OpenAILike calls by default), with RAG on the
prompt: the prompt is the question, answered over the retrieved chunks like /v1/query."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from app.chat.protocol import ChatUsage
from app.openai_compat import StreamOptions, check_extra_fields
from app.query.protocol import CitationOut, GenerationOptions, PlanOut, SourceOut, StrictInt, TimingsOut


class CompletionRequest(GenerationOptions):
    """OpenAI's completion fields plus the RAG extras; refused and ignored fields as for chat completions."""

    model_config = ConfigDict(extra="allow")  # checked by check_fields (a 400 or a 422 naming them)

    model: str | None = Field(None, description="The served model, or `<model>:<collection>` to pick a knowledge "
                              "base.")
    prompt: str | list[str] = Field(..., description="The question (a list: exactly one).")
    stop: str | list[str] | None = None
    n: StrictInt = Field(1, ge=1, description="Only one choice is generated (n > 1 is a 400).")
    stream_options: StreamOptions | None = None

    def check_fields(self) -> None:
        check_extra_fields(self.model_extra, {"n": self.n})

    @property
    def question(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: ChatUsage | None = None
    sources: list[SourceOut] | None = None  # in the response and on the first chunk
    citations: list[CitationOut] | None = None  # the sources the answer cites as [n]: response, last chunk
    timings: TimingsOut | None = None
    mode: str | None = None
    recompute_ratio: float | None = None
    quality_guarded: bool | None = None  # the quality guard raised the recompute ratio
    plan: PlanOut | None = None
    unsupported: list[str] | None = None  # the answer's numbers and names no source, nor the question, contains
    warnings: list[str] | None = None
