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


S192_FLOOR = {"retrieval": {"chunking": "structure", "chunk_tokens": 192, "min_score": 0.35, "score_margin": 0.15}}
T192_FLOOR = {"retrieval": {"chunking": "tokens", "chunk_tokens": 192, "min_score": 0.35, "score_margin": 0.15}}
# the model told to refuse when the documents do not hold the answer (instead of, or beside, the floor)
REFUSE_PROMPT = ("You are a helpful assistant. Answer the question using the documents. If the documents do not "
                 "contain the answer, reply: I could not find this in the documents.")
S192_PROMPT = {"retrieval": {"chunking": "structure", "chunk_tokens": 192, "min_score": 0.35, "score_margin": 0.15},
               "model": {"system_prompt": REFUSE_PROMPT}}

# The retrieval defaults before issue 36's item 2 (main at 27ff4d7): sentence chunks of 384 tokens, dense, top 5,
# no relevance floor
BEFORE = {"retrieval": {"chunking": "tokens", "chunk_tokens": 384, "mode": "dense", "top_k": 5, "min_score": -1.0,
                        "score_margin": 2.0, "refuse_unmentioned_names": False}}

EXACT_WORDS = "Answer briefly in the documents' exact words and cite your source."

# stop 53: a worked example in the system prompt (part of the prefix the chunks are precomputed behind, so the
# prefix cache and the chunks' stored KV carry it: no extra prefill per question), showing a terse answer copied
# from the documents with its number
ONE_SHOT = ("You are a helpful assistant. Answer the question using the documents: reply with the words of the "
            "document that answer it, then its number.\n\nExample:\nDocuments:\n\n[1] The server listens on "
            "port 8080 unless PORT is set in /etc/server.conf.\n\nQuestion: Which port does the server listen "
            "on by default?\nAnswer: 8080 [1]")
TWO_SHOT = ONE_SHOT + ("\n\nExample:\nDocuments:\n\n[2] Logs older than 14 days are removed.\n\n[1] "
                       "Settings are read from /etc/server.conf, then from ~/.server.conf.\n\nQuestion: Which "
                       "file is read first for the settings?\nAnswer: /etc/server.conf [1]")

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
    # blend's recompute share (the server's default 0.15; full is 1.0): where blend loses answers to full
    Setting("ratio=0.3", request={"recompute_ratio": 0.3}),
    Setting("ratio=0.5", request={"recompute_ratio": 0.5}),
    # blend's scaled attention to reused tokens (docs/decisions/0003: 0.5, chosen on MuSiQue's KL; 1 = none)
    Setting("attention-scale=1", server={"blend": {"reused_attention_scale": 1.0}}),
    Setting("attention-scale=0.75", server={"blend": {"reused_attention_scale": 0.75}}),
    # a prefill's attention in the model's dtype (float32) instead of auto's bf16 (docs/decisions/0023)
    Setting("attention-fp32", server={"model": {"attention_dtype": "model"}}),
    Setting("full-attention-fp32", request={"mode": "full"}, server={"model": {"attention_dtype": "model"}}),
    # the prefill copies' dtype forced to bf16 (docs/decisions/0025: auto measures which is faster per machine)
    Setting("gemm-bf16", server={"model": {"gemm_dtype": "bfloat16"}}),
    Setting("gemm-bf16-full", request={"mode": "full"}, server={"model": {"gemm_dtype": "bfloat16"}}),
    Setting("top_k=2", request={"top_k": 2}),
    Setting("top_k=10", request={"top_k": 10}),
    # repetition control and the stop (docs/decisions/0021): each of today's defaults taken away, and a penalty
    Setting("no-stop", request={"stop": []}),  # answers not ended at a blank line (generation.stop)
    Setting("no-ngram-block", request={"no_repeat_ngram_size": 0}),
    Setting("neither", request={"stop": [], "no_repeat_ngram_size": 0}),  # the sampling shipped before 0021
    Setting("repetition=1.2", request={"repetition_penalty": 1.2}),  # CTRL's penalty over the answer
    Setting("best-first", server={"model": {"chunk_order": "best_first"}}),  # [1] first in the prompt, as before 0021
    Setting("answer-briefly", server={"model": {"answer_instruction": "Answer briefly."}}),  # no ask to cite
    # blend's selection (docs/decisions/0002: query attention at a probe, chosen on MuSiQue's KL): the others
    Setting("select-deviation", request={"selection": "deviation"}),  # CacheBlend's own ranking (checks at layer 1)
    Setting("select-query-deviation", request={"selection": "query_deviation"}),
    Setting("select-query-chunk-start", request={"selection": "query_chunk_start"}),
    # stop 52, blend's copying of numbers and paths: the instruction asks for the documents' own words
    Setting("exact-words", server={"model": {"answer_instruction": EXACT_WORDS}}),
    Setting("exact-words-full", request={"mode": "full"}, server={"model": {"answer_instruction": EXACT_WORDS}}),
    # stop 53: worked examples in the system prompt, blend and full
    Setting("one-shot", server={"model": {"system_prompt": ONE_SHOT}}),
    Setting("one-shot-full", request={"mode": "full"}, server={"model": {"system_prompt": ONE_SHOT}}),
    Setting("two-shot", server={"model": {"system_prompt": TWO_SHOT}}),
    Setting("two-shot-full", request={"mode": "full"}, server={"model": {"system_prompt": TWO_SHOT}}),
    # issue 36 item 2 (context that holds the answer): chunking, ranking, relevance floor (docs/decisions/0022)
    Setting("s192-hybrid-k3", request={"retrieval": "hybrid", "top_k": 3}, server=S192_FLOOR),
    Setting("s192-hybrid-k2", request={"retrieval": "hybrid", "top_k": 2}, server=S192_FLOOR),
    Setting("s192-hybrid-k4", request={"retrieval": "hybrid", "top_k": 4}, server=S192_FLOOR),
    Setting("s192-dense-k3", request={"retrieval": "dense", "top_k": 3}, server=S192_FLOOR),
    Setting("s192-lexical-k3", request={"retrieval": "lexical", "top_k": 3}, server=S192_FLOOR),
    Setting("t192-hybrid-k3", request={"retrieval": "hybrid", "top_k": 3}, server=T192_FLOOR),
    Setting("s192-prompt-k3", request={"retrieval": "hybrid", "top_k": 3}, server=S192_PROMPT),
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
