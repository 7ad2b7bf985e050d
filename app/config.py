"""The HTTP server's frozen configs (the settings' `server` and `limits` sections): the one place their
defaults live. The scheduler's own bounds are `runtime.config.SchedulerConfig` (the `scheduler` section)."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass

_CONFIG = ConfigDict(extra="forbid", validate_default=True)


@dataclass(frozen=True, config=_CONFIG)
class ServerConfig:
    host: Annotated[str, Field(description="Bind address of `ragblend serve`.")] = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535, description="Port of `ragblend serve`.")] = 8000
    api_key: Annotated[str | None, Field(
        description="The server's own key: when set, every route but /healthz, /readyz and the chat page "
        "needs Bearer KEY (this one, or a scoped key). Scoped keys (/v1/keys) are made only when it is set: "
        "without it a request with no key may do everything, unless the store holds a live scoped key "
        "(docs/decisions/0029).")] = None
    model_id: Annotated[str | None, Field(
        description="Model id shown by /v1/models (default: the engine's name).")] = None
    allow_public_without_key: Annotated[bool, Field(
        description="Let `ragblend serve` listen on a non-loopback host with no api_key (refused "
        "otherwise).")] = False
    header_timeout_s: Annotated[float, Field(
        gt=0.0, le=3600.0, description="A connection whose request headers are not all in by then is "
        "closed.")] = 10.0
    body_timeout_s: Annotated[float, Field(
        gt=0.0, le=3600.0, description="A request body not all in by then (from its first byte read) is a "
        "408.")] = 30.0
    shutdown_timeout_s: Annotated[float, Field(
        gt=0.0, le=3600.0, description="On SIGTERM/SIGINT, requests in flight get this long to finish; then they "
        "are cancelled, the engine worker stops (a running ingest after its current document) and the stores "
        "close.")] = 10.0
    allowed_hosts: Annotated[tuple[str, ...] | None, Field(
        description="Host header names the server answers (port ignored; '*': any); others get a 403 (DNS "
        "rebinding). Default (null): localhost, 127.0.0.1, ::1 and server.host; any name when server.host is a "
        "wildcard address (0.0.0.0, ::), where the API key guards.")] = None
    allowed_origins: Annotated[tuple[str, ...], Field(
        description="Browser origins (scheme://host:port; '*': any) besides the server's own whose pages may send "
        "POST/PUT/PATCH/DELETE; a request with another Origin gets a 403 (drive-by writes).")] = ()


@dataclass(frozen=True, config=_CONFIG)
class LimitsConfig:
    max_body_bytes: Annotated[int, Field(ge=1024, description="Largest request body (413 above).")] = 8_000_000
    max_document_chars: Annotated[int, Field(
        ge=1, description="Largest document text; its KV (one token per char) must fit the store bound.")] = 500_000
    max_documents_per_request: Annotated[int, Field(
        ge=1, description="Documents in one POST /v1/documents.")] = 64
    max_top_k: Annotated[int, Field(ge=1, le=1000, description="Largest top_k a request may ask.")] = 20
    max_tokens: Annotated[int, Field(ge=1, description="Largest max_tokens a request may ask.")] = 1024
    max_question_chars: Annotated[int, Field(ge=1, description="Longest question / user message.")] = 4000
    max_history_messages: Annotated[int, Field(
        ge=0, description="Most earlier messages in one chat request (422 above, before anything is "
        "tokenized).")] = 200
    max_history_chars: Annotated[int, Field(
        ge=0, description="Most characters in a chat request's earlier messages together (422 above, before "
        "anything is tokenized; SmolLM2's 8192-token context holds ~30 000; raise it for a longer-context "
        "model).")] = 100_000
    max_chunk_ids: Annotated[int, Field(ge=1, description="Longest chunk_ids list.")] = 32
    max_upload_bytes: Annotated[int, Field(
        ge=1024, description="Largest request body of POST /v1/documents/files (413 above).")] = 100_000_000
    max_unzipped_bytes: Annotated[int, Field(
        ge=1024, description="A DOCX expanding past this is refused (zip bombs; 413).")] = 200_000_000
