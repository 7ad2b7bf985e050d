"""What the OpenAI-compatible routes (/v1/chat/completions, /v1/completions) share: the OpenAI fields
refused (asked for: a 400 naming them, as vLLM answers) or ignored (sent by real clients, documented in
docs/api.md), any other unknown field refused (422, as on every other route), `stream_options`, and the
model name that picks a knowledge base (`<model>:<collection>`)."""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, StrictBool

from app.collections.names import name_problem, shown
from app.errors import InvalidRequestError, NotFoundError, UnsupportedParameterError


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {}


# OpenAI parameters ragblend does not implement, each with what counts as not asking for it.
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
    "best_of": lambda value: value in (None, 1),
    "echo": _is_unset,
    "suffix": lambda value: value in (None, ""),
    "metadata": _is_unset,  # stored completions' tags; not a retrieval filter (use `collection`)
}

# OpenAI fields real clients send that change nothing here: accepted and ignored (docs/api.md).
IGNORED_PARAMETERS = frozenset({
    "user", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier",
    "reasoning_effort", "verbosity",
})

_COLLECTION_HINT = ("to pick a knowledge base, send `collection` (a name or a list) or the model name "
                    "`<model>:<collection>` (GET /v1/models lists them)")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False  # a last chunk with empty `choices` and the usage (OpenAI's stream format)
    include_obfuscation: StrictBool | None = None  # accepted, ignored: nothing here is obfuscated


def check_extra_fields(extra: dict[str, Any] | None, given: dict[str, Any]) -> None:
    """Refuse (400) the unsupported OpenAI parameters asked for, and (422) any field that is neither an
    OpenAI field ignored here nor ragblend's own. `given`: the declared fields the table also covers."""
    extra = extra or {}
    values = {**given, **extra}
    unsupported = [name for name, is_unasked in UNSUPPORTED_PARAMETERS.items()
                   if name in values and not is_unasked(values[name])]
    if unsupported:
        hint = f"; {_COLLECTION_HINT}" if "metadata" in unsupported else ""
        raise UnsupportedParameterError(f"unsupported parameter(s): {', '.join(unsupported)}; ragblend answers "
                                        f"with one plain-text choice, without tools or log-probabilities{hint}")
    unknown = sorted(set(extra) - set(UNSUPPORTED_PARAMETERS) - IGNORED_PARAMETERS)
    if unknown:
        raise InvalidRequestError(f"unknown field(s): {', '.join(unknown[:10])} (docs/api.md lists the fields; "
                                  f"{_COLLECTION_HINT})")


def collection_of_model(model: str | None, model_id: str) -> str | None:
    """The collection a model name picks: `<model_id>:<collection>` picks one, checked as the
    `collection` field's names are (a 422 with the same message), `<model_id>` (or none) none; any other
    name is a 404."""
    if model is None or model == model_id:
        return None
    prefix = f"{model_id}:"
    if model.startswith(prefix) and len(model) > len(prefix):
        name = model[len(prefix):]
        problem = name_problem(name)
        if problem is not None:
            raise InvalidRequestError(f"model: {problem}")
        return name
    raise NotFoundError(f"model not found: {shown(model)}; this server serves {model_id!r}, and "
                        f"{model_id!r}:<collection> for each knowledge base (GET /v1/models)")


def requested_collections(named: list[str] | None, model: str | None, model_id: str) -> list[str] | None:
    """The collections a request asks for: its `collection` field, or its model name's; both, they must agree."""
    from_model = collection_of_model(model, model_id)
    if from_model is None:
        return named
    if named is not None and named != [from_model]:
        raise InvalidRequestError(f"the model name picks collection {from_model!r} but `collection` names "
                                  f"{', '.join(named)}: send one of the two")
    return [from_model]
