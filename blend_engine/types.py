"""The engine's typed inputs and outputs: frozen config apart from per-request results."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from blend_engine.kv import CachedChunk, KVCache
from configs.settings import BlendSettings, DeviationKind, HeadReduce, PrefillMode, ScoreCombine, SelectionKind

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
class BlendConfig:
    """How `blend` mode selects tokens to recompute. Frozen: per request, pass a new one."""

    recompute_ratio: float = 0.15  # share of *reused* tokens recomputed from the last check layer on
    check_layers: tuple[int, ...] = (1,)  # where deviation is measured; several = gradual filtering
    filter_growth: float = 2.0  # check j of n keeps ratio * growth**(n-1-j) (capped at 1)
    deviation: DeviationKind = DeviationKind.VALUE
    selection: SelectionKind = SelectionKind.DEVIATION
    chunk_start_tokens: int = 8  # chunk_start selections: each chunk's first tokens, always
    # Query selections: where the question's attention is measured. None: at the check layer; a deeper
    # layer: a probe runs the fresh tokens alone over the reused cache from the first check layer up to
    # it (cheap: the question and separators only; nothing else is recomputed for it).
    probe_layer: int | None = None
    probe_span: int = 1  # the probe sums the question's attention over this many layers, ending at probe_layer
    query_heads: HeadReduce = HeadReduce.SUM  # how the heads' attention masses combine
    query_tokens: int = 0  # only the question's last tokens' attention counts (0: all of them)
    combine: ScoreCombine = ScoreCombine.PRODUCT  # query_deviation: mass x deviation, or their rank sum
    is_shift_measured: bool = False  # report PrefillStats.last_token_shift (two one-query attentions more)
    # Adaptive ratio: recompute the fewest top-ranked tokens covering this share of the candidates'
    # total score, within [min_ratio, max_ratio]; `recompute_ratio` is then unused.
    adaptive_mass: float | None = None
    min_ratio: float = 0.05
    max_ratio: float = 0.5
    # Quality guard: when the tokens left unselected hold more than this share of the score, the
    # request is risky and its ratio is raised to `guard_ratio`.
    guard_unselected_mass: float | None = None
    guard_ratio: float = 0.5
    # Attention temperature on reused KV (blend and reuse): keys of chunks not computed at their place
    # (not behind exactly the tokens before them) are multiplied by this from the layer after the last
    # check on, so the question and the recomputed tokens attend to them less sharply. 1.0 here is
    # CacheBlend (the engine's own tests rely on it); the server's default (settings) is 1.0 as well since
    # the attention scale below replaced it (README: both calibrated).
    reused_key_scale: float = 1.0
    # Attention weight on the same reused tokens (APE's scaling factor): from the same layer on, every
    # query's attention weight on a reused token of an inexact chunk (not one blend recomputed) is
    # multiplied by this before the softmax normalizes (a logit bias of log scale), in the prefill and
    # for every token after it (decode, scoring). 1.0: none (CacheBlend); the server's default: settings.
    reused_attention_scale: float = 1.0
    # The cached positions to recompute, given instead of ranked (`selection` then ranks nothing): to
    # compare two caches of the same chunks under one selection (the KV formats' fidelity bench).
    selected_positions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.selected_positions is not None and any(p < 0 for p in self.selected_positions):
            raise ValueError("selected_positions must be >= 0")
        if not 0.0 < self.reused_key_scale <= 2.0:
            raise ValueError(f"reused_key_scale must be in (0, 2], got {self.reused_key_scale}")
        if not 0.0 < self.reused_attention_scale <= 4.0:
            raise ValueError(f"reused_attention_scale must be in (0, 4], got {self.reused_attention_scale}")
        if self.chunk_start_tokens < 0 or self.query_tokens < 0:
            raise ValueError("chunk_start_tokens and query_tokens must be >= 0")
        if self.probe_span < 1:
            raise ValueError("probe_span must be >= 1")
        for name in ("adaptive_mass", "guard_unselected_mass", "min_ratio", "max_ratio", "guard_ratio"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.min_ratio > self.max_ratio:
            raise ValueError("min_ratio must be <= max_ratio")
        if self.is_ratio_decided_at_check and len(self.check_layers) > 1:
            raise ValueError("an adaptive ratio or a quality guard needs exactly one check layer")
        if not 0.0 <= self.recompute_ratio <= 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1], got {self.recompute_ratio}")
        if not self.check_layers or list(self.check_layers) != sorted(set(self.check_layers)):
            raise ValueError(f"check_layers must be non-empty and strictly increasing, got {self.check_layers}")
        if self.check_layers[0] < 0:
            raise ValueError("check layers must be >= 0")
        if self.filter_growth < 1.0:
            raise ValueError("filter_growth must be >= 1")
        if self.probe_layer is not None and self.probe_layer <= self.check_layers[0]:
            raise ValueError(f"probe_layer must be after the first check layer {self.check_layers[0]}")

    def fitted(self, num_layers: int) -> BlendConfig:
        """This config on a model of `num_layers` layers, as the server's defaults need it: a probe past
        the last layer probes at the last one (none where that is not after the first check); a
        deviation-ranked selection checks at layer 1 at least (at layer 0 a chunk's K/V do not depend
        on its context, so their deviation is zero)."""
        config = self
        if config.selection.is_deviation and config.first_check_layer == 0 and num_layers > 1:
            checks = tuple(sorted({max(1, layer) for layer in config.check_layers}))
            probe = config.probe_layer if config.probe_layer is None or config.probe_layer > 1 else None
            config = replace(config, check_layers=checks, probe_layer=probe)
        if config.probe_layer is not None and config.probe_layer >= num_layers:
            last = num_layers - 1
            config = replace(config, probe_layer=last if last > config.first_check_layer else None)
        return config

    @property
    def first_check_layer(self) -> int:
        """Layers before it compute every token and read no reused KV (check_layers is never empty)."""
        return self.check_layers[0]

    @classmethod
    def from_settings(cls, settings: BlendSettings) -> BlendConfig:
        return cls(
            recompute_ratio=settings.recompute_ratio,
            check_layers=tuple(settings.check_layers),
            filter_growth=settings.filter_growth,
            deviation=settings.deviation,
            selection=settings.selection,
            chunk_start_tokens=settings.chunk_start_tokens,
            probe_layer=settings.probe_layer,
            probe_span=settings.probe_span,
            query_heads=settings.query_heads,
            query_tokens=settings.query_tokens,
            combine=settings.combine,
            min_ratio=settings.adaptive_min_ratio,
            max_ratio=settings.adaptive_max_ratio,
            guard_unselected_mass=settings.guard_unselected_mass,
            guard_ratio=settings.guard_ratio,
            reused_key_scale=settings.reused_key_scale,
            reused_attention_scale=settings.reused_attention_scale,
        )

    @property
    def is_reuse_scaled(self) -> bool:
        """Whether the reused tokens' keys or attention are scaled (else CacheBlend's own reuse / blend)."""
        return self.reused_key_scale != 1.0 or self.reused_attention_scale != 1.0

    @property
    def is_ratio_decided_at_check(self) -> bool:
        """The kept count is read back at the check layer (one host read per request)."""
        return self.adaptive_mass is not None or self.guard_unselected_mass is not None

    def ratio_at_check(self, check_idx: int) -> float:
        """Share of reused tokens kept at the `check_idx`-th check layer."""
        num_after = len(self.check_layers) - 1 - check_idx
        return min(1.0, self.recompute_ratio * self.filter_growth**num_after)


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
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    is_eos_ignored: bool = False  # generate max_tokens whatever the model says (benchmarks: vLLM's ignore_eos)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context limit


@dataclass(frozen=True)
class Delta:
    """A piece of streamed text; the last one carries `finish_reason`."""

    text: str
    num_tokens: int  # completion tokens generated so far
    finish_reason: FinishReason | None = None
