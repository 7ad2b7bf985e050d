"""The settings `ragblend bench answers` compares side by side. A setting is a name, the /v1/query
fields it adds to every request, and the server settings it overrides (nested by section as in docs/configuration.md;
settings with the same overrides share one server). Adding a setting is one line in SETTINGS, e.g.

    Setting("chunks-256", server={"retrieval": {"chunk_tokens": 256}}),
    Setting("ratio-0.3", request={"recompute_ratio": 0.3}),
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence


@dataclass(frozen=True)
class Setting:
    name: str
    request: Mapping[str, Any] = field(default_factory=dict)  # /v1/query fields, e.g. {"mode": "full"}
    server: Mapping[str, Any] = field(default_factory=dict)  # settings overrides, e.g. {"retrieval": {"top_k": 3}}

    @property
    def server_key(self) -> str:
        """Settings with equal keys run on one server."""
        return json.dumps(self.server, sort_keys=True)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "request": dict(self.request), "server": dict(self.server)}


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("default"),  # today's defaults: nothing added to the request, the server as shipped
    Setting("full", request={"mode": "full"}),  # a full prefill: reads every retrieved chunk again
    Setting("top_k=2", request={"top_k": 2}),
    Setting("top_k=10", request={"top_k": 10}),
    # repetition control and the stop (docs/decisions/0021): each of today's defaults taken away, and a penalty
    Setting("no-stop", request={"stop": []}),  # answers not ended at a blank line (generation.stop)
    Setting("no-ngram-block", request={"no_repeat_ngram_size": 0}),
    Setting("neither", request={"stop": [], "no_repeat_ngram_size": 0}),  # the sampling shipped before 0021
    Setting("repetition=1.2", request={"repetition_penalty": 1.2}),  # CTRL's penalty over the answer
    Setting("best-first", server={"model": {"chunk_order": "best_first"}}),  # [1] first in the prompt, as before 0021
    Setting("answer-briefly", server={"model": {"answer_instruction": "Answer briefly."}}),  # no ask to cite
)}


def settings_named(names: Sequence[str]) -> list[Setting]:
    """The registered settings of `names`, in that order; ValueError naming any unknown or repeated one."""
    unknown = [name for name in names if name not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown settings {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"settings named twice: {', '.join(repeated)}")
    if not names:
        raise ValueError("no settings given")
    return [SETTINGS[name] for name in names]
