"""The loading controller (CacheBlend §5): pick the recompute ratio whose compute hides the load.

Per layer, the engine recomputes r * N cached tokens (+ the uncached ones) while the next layer's
KV streams in. Loading the chunks' stored bytes takes `load_s` at the tiers' measured throughput;
recomputing costs `seconds_per_token_layer` per token and layer. The largest useful ratio is the
one where compute time equals load time: a higher ratio would add delay, a lower one would leave
the engine waiting on loads for no quality gain. The result never goes below the quality floor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from kv_store.backend import Tier
from kv_store.loader import StoredChunk

# Bytes/s assumed for a tier before any load was measured on it (memory: host copy; disk: page
# cache or NVMe; Redis: loopback or LAN). Measurements replace them as soon as a load happens.
PRIOR_THROUGHPUT = {Tier.MEMORY: 10e9, Tier.DISK: 1e9, Tier.REDIS: 0.5e9}


@dataclass(frozen=True)
class EngineProfile:
    """How fast the engine recomputes: seconds per token per layer (measured)."""

    num_layers: int
    seconds_per_token_layer: float

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.seconds_per_token_layer <= 0:
            raise ValueError(f"bad engine profile: {self.num_layers} layers, {self.seconds_per_token_layer} s/token-layer")

    @classmethod
    def measure(cls, engine, num_tokens: int = 256, num_repeats: int = 2) -> EngineProfile:
        """Time full prefills of `num_tokens` random tokens (best of `num_repeats`, after a warm-up)."""
        from blend_engine.types import PrefillMode, Segment  # the engine is only needed here

        vocab = int(engine.model.config.vocab_size)
        ids = tuple(torch.randint(0, vocab, (num_tokens,), generator=torch.Generator().manual_seed(0)).tolist())
        engine.prefill([Segment(ids)], mode=PrefillMode.FULL)
        best = float("inf")
        for _ in range(num_repeats):
            start = time.perf_counter()
            engine.prefill([Segment(ids)], mode=PrefillMode.FULL)
            best = min(best, time.perf_counter() - start)
        return cls(engine.num_layers, best / (num_tokens * engine.num_layers))


@dataclass(frozen=True)
class RatioDecision:
    ratio: float
    hiding_ratio: float  # the ratio whose compute equals the load, before the floor/ceiling
    predicted_load_s: float
    predicted_compute_s: float  # at `ratio`
    is_floor_applied: bool


@dataclass(frozen=True)
class LoadingController:
    min_ratio: float  # the quality floor
    max_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_ratio <= self.max_ratio <= 1.0:
            raise ValueError(f"need 0 <= min_ratio ({self.min_ratio}) <= max_ratio ({self.max_ratio}) <= 1")

    def load_seconds(self, handles: Sequence[StoredChunk], throughput: Mapping[Tier, float | None]) -> float:
        """Predicted time to load every layer of every chunk from its tier."""
        total = 0.0
        for h in handles:
            rate = throughput.get(h.tier) or PRIOR_THROUGHPUT[h.tier]
            total += h.layer_nbytes * h.num_layers / rate
        return total

    def choose(
        self,
        handles: Sequence[StoredChunk],
        profile: EngineProfile,
        throughput: Mapping[Tier, float | None],
        num_fresh_tokens: int = 0,
    ) -> RatioDecision:
        num_cached = sum(h.num_tokens for h in handles)
        load_s = self.load_seconds(handles, throughput)
        per_token_s = profile.seconds_per_token_layer * profile.num_layers  # one token through the model
        if num_cached == 0:
            return RatioDecision(self.min_ratio, 0.0, load_s, num_fresh_tokens * per_token_s, True)
        hiding = (load_s / per_token_s - num_fresh_tokens) / num_cached
        ratio = min(self.max_ratio, max(self.min_ratio, hiding))
        compute_s = (ratio * num_cached + num_fresh_tokens) * per_token_s
        return RatioDecision(ratio, hiding, load_s, compute_s, is_floor_applied=hiding < self.min_ratio)
