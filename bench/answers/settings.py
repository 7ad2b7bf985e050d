"""The settings `ragblend bench answers` compares side by side: a name, the /v1/query fields it adds and the
server settings it overrides; adding one is one line in SETTINGS (docs/benchmarks/answers.md)."""

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


# The retrieval defaults before issue 36's item 2 (main at 27ff4d7): sentence chunks of 384 tokens, dense, top 5,
# no relevance floor
BEFORE = {"retrieval": {"chunking": "tokens", "chunk_tokens": 384, "mode": "dense", "top_k": 5, "min_score": -1.0,
                        "score_margin": 2.0, "refuse_unmentioned_names": False}}

# The tries whose question is answered (ratio, attention scale and dtype, GEMM dtype, top k, sampling and prompt,
# selection, exact words, worked examples, decision 0022's candidates) were retired in issue 64:
# docs/benchmarks/answers.md#settings-adding-one-is-one-line, `git show 66ac7e4:bench/answers/settings.py`.
SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("default"),  # today's defaults: nothing added to the request, the server as shipped
    Setting("before", server=BEFORE),  # the defaults before docs/decisions/0021
    Setting("before-k3", request={"top_k": 3}, server=BEFORE),
    Setting("default-k5", request={"top_k": 5}),
    # stop 55: questions naming what no document mentions answered by the model, as before the rule
    Setting("names-off", server={"retrieval": {"refuse_unmentioned_names": False}}),
    Setting("dense", request={"retrieval": "dense"}),
    Setting("lexical", request={"retrieval": "lexical"}),
    Setting("full", request={"mode": "full"}),  # a full prefill: reads every retrieved chunk again
    # stop 70: blend's probe at layer 18 (fitted on the Qwen models' KL; not adopted: docs/decisions/0032)
    Setting("probe-18", server={"blend": {"probe_layer": 18}}),
    # stop 79: layer 18 within a cost budget, so short prompts probe at 8 (opt-in: docs/decisions/0039)
    Setting("probe-18-budget", server={"blend": {"probe_layer": 18, "probe_budget": 0.3}}),
    Setting("torch-kernels", server={"model": {"decode_kernel": "torch"}}),  # decode's int4/int8 matmuls by torch's
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
