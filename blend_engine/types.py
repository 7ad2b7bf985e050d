"""The engine's typed inputs and outputs: frozen config apart from per-request results."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from blend_engine.kv import CachedChunk, KVCache
from blend_engine.config import BlendConfig, GenerationConfig
from configs.enums import DeviationKind, HeadReduce, PrefillMode, RepetitionScope, ScoreCombine, SelectionKind

__all__ = [
    "BlendConfig",
    "Delta",
    "DeviationKind",
    "FinishReason",
    "HeadReduce",
    "PrefillMode",
    "PrefillResult",
    "PrefillStats",
    "SamplingParams",
    "ScoreCombine",
    "Segment",
    "SelectionKind",
]


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens; `kv` set when a reused cache exists for exactly these tokens."""

    token_ids: tuple[int, ...]
    kv: CachedChunk | None = None  # a ChunkKV, or a store handle whose layers come from a LayerKVSource

    def __post_init__(self) -> None:
        if self.kv is not None and self.kv.num_tokens != len(self.token_ids):
            raise ValueError(f"segment has {len(self.token_ids)} tokens but its KV has {self.kv.num_tokens}")


@dataclass
class PrefillStats:
    mode: PrefillMode
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # tokens that came with a reusable KV
    num_reused_tokens: int = 0  # cached tokens whose reused KV was kept (not recomputed)
    num_recomputed_tokens: int = 0  # tokens computed fresh through every layer
    num_prefix_cached_tokens: int = 0  # the prompt's first tokens whose KV a prefix cache served as it was
    kv_load_ms: float = 0.0  # time spent waiting on the KV source
    rope_ms: float = 0.0  # re-positioning reused keys
    select_ms: float = 0.0  # deviation + top-k at the check layers
    compute_ms: float = 0.0  # the layer loop's own work
    prefill_ms: float = 0.0  # wall time of the whole prefill (to the first token's logits)
    recompute_ratio: float | None = None  # the ratio used (blend), e.g. chosen by a loading controller
    selected_positions: list[int] = field(default_factory=list)  # cached-token positions recomputed (blend)
    is_timing_exact: bool = True  # stage splits measured (CPU always; CUDA only when profiled)
    unselected_mass: float | None = None  # share of the ranking score left unselected at the first check (blend)
    is_guarded: bool = False  # the quality guard raised the ratio
    last_token_shift: float | None = None  # blend: relative change of the last token's attention output at the
    # first check, reused vs fresh K/V (a candidate guard signal, measured in the README)


@dataclass
class PrefillResult:
    token_ids: list[int]  # the whole prompt
    cache: KVCache  # fused cache, length == len(token_ids)
    logits: torch.Tensor  # [vocab] float32, next-token logits after the prompt
    stats: PrefillStats


@dataclass(frozen=True)
class SamplingParams:
    # a request's own; where it leaves them out, the configured `generation` section's (whose defaults these are)
    max_tokens: int = GenerationConfig.max_tokens
    temperature: float = GenerationConfig.temperature  # 0 = greedy
    top_p: float = GenerationConfig.top_p
    seed: int | None = None
    stop: tuple[str, ...] = GenerationConfig.stop
    is_eos_ignored: bool = False  # generate max_tokens whatever the model says (benchmarks: vLLM's ignore_eos)
    # repetition control (blend_engine/generate.py RepetitionControl; their meaning: GenerationConfig's)
    repetition_penalty: float = GenerationConfig.repetition_penalty  # 1: off
    repetition_scope: RepetitionScope = GenerationConfig.repetition_scope
    frequency_penalty: float = GenerationConfig.frequency_penalty  # 0: off
    presence_penalty: float = GenerationConfig.presence_penalty  # 0: off
    no_repeat_ngram_size: int = GenerationConfig.no_repeat_ngram_size  # 0: off

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.no_repeat_ngram_size < 0:
            raise ValueError("no_repeat_ngram_size must be >= 0")

    @property
    def is_repetition_controlled(self) -> bool:
        """Whether any penalty or n-gram block changes the logits (else they are sampled as they come)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.no_repeat_ngram_size > 0)


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit


@dataclass(frozen=True)
class Delta:
    """A piece of streamed text; the last one carries `finish_reason`."""

    text: str
    num_tokens: int  # completion tokens generated so far
    finish_reason: FinishReason | None = None
